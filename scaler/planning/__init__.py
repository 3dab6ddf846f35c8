"""Plan: demand outlooks from the store and the forecaster, the capacity planner and its
margin, and the reactive demand pending jobs make."""
