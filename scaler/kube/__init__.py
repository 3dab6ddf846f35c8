"""Kubernetes through the official client: the one pod -> job and node -> spec translation
(`objects`), the one listing into the cluster snapshot (`observed`), cordon and drain before
a node's instance goes (`nodes`), placeholder pods that hold warm capacity until real jobs
preempt them (`placeholders`), and the one way a failed API call is sorted (`errors`)."""
