"""Development tools shared by the tests and the benchmarks: a local Kubernetes control
plane (`devcluster`), `pdpool serve` processes (`engine_procs`) and the operator as a process
with PDInferencePool calls (`operator_kube`).

Never installed: setup.py maps only pdpool's folders. Import it from the repository root
(`python -m pytest` and the benchmarks put the root on sys.path).
"""
