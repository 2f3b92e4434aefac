"""The harness: drives the real parts for tests and benchmarks: processes, Pi, workloads, faults.

What both the tests and the benchmarks need to run kv-elision for real lives here once: the Pi
driver and its environment (`pi`), the /proc reader (`procfs`), the generated sessions (`workload`,
`shapes`, `fact_script`, `corpus`) and the agent that plays them over HTTP (`agent`), and the
reliability campaign's machinery (`faults`: the zygote, the driver, the twins, the crash, storage,
fuzz, session and access checks). Processes are started and ended through serving.launcher (one
process stop, one health wait).

Dependency rule: the harness may import serving, backends, controller and contextd; none of those
imports it. benchmarks/ and tests/ import it; it imports neither (tests/unit/test_layers.py checks).
"""
