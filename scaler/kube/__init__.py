"""Actions on a Kubernetes cluster through the official client: cordon and drain a node
before its cloud instance goes (`nodes`), and placeholder pods that hold warm capacity
until real jobs preempt them (`placeholders`)."""
