"""P/D-aware autoscaling: one planner shared by the operator and `pdpool up --autoscale`.

metrics.py parses the engines' and sidecars' Prometheus text into a snapshot; signals.py
turns two snapshots into what each role saw in the window between them (p90 TTFT and ITL
from the histograms' deltas, queues, KV usage, token rates); policy.py recommends replicas
per role from those signals and the targets; stabilize.py damps the recommendations
(stabilization windows, maximum step, cool-down) into a decision. All pure: the decisions
are unit-tested on recorded traces. scrape.py is the one part that does I/O (HTTP GET).
No heavy imports: the operator and the sidecar's slim images import this package."""
