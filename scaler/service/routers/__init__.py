"""One router per resource; route functions only translate between HTTP and the parts."""
