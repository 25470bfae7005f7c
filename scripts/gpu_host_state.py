"""Why does the eager host probe (timing.host_probe) fall into two states, ~1.0x and ~1.4x its fastest? (issue 10;
H100 2026-12-06, round 19: whole buckets alternated between the states and Triton's host-bound decode with them,
46 vs 80 us.) Hypothesis: the process moves between CPUs, some far from the GPU (another NUMA node or socket).

Usage (device): python3 scripts/gpu_host_state.py OUT.json
1. The machine: the GPU's PCI address, its NUMA node and local CPUs (sysfs), the process's allowed CPUs, the NUMA
   nodes' CPU lists, `nvidia-smi topo -m`.
2. Unpinned: 300 rounds of what a bucket does between timings (allocate 64 MiB, free it, empty the cache, sync),
   then the probe; the CPU (sched_getcpu) before and after each probe.
3. Pinned: the same 100 rounds with the process pinned to (a) the GPU's local CPUs among the allowed, (b) each NUMA
   node's allowed CPUs, (c) one CPU of each node.
4. Triton's eager decode at 4 x 256 (32/8 heads, bf16, page 16), host-bound: CUDA-event time per call unpinned and
   under each pinning of 3.
Printed: per setting the probe's median, 10th and 90th percentile (us) and the share of rounds above 1.2x the
overall fastest; unpinned, the probe's median per CPU seen.
"""
import ctypes
import json
import os
import statistics
import subprocess
import sys

import torch

from attnsel import backends
from attnsel.spec import AttentionSpec
from attnsel.validate import timing

out_path = sys.argv[1]
dev = torch.device("cuda")
libc = ctypes.CDLL(None)


def cpu() -> int:
    return libc.sched_getcpu()


def read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cpulist(text: str | None) -> set[int]:
    cpus: set[int] = set()
    for part in (text or "").split(","):
        if "-" in part:
            a, b = part.split("-")
            cpus.update(range(int(a), int(b) + 1))
        elif part.strip():
            cpus.add(int(part))
    return cpus


props = torch.cuda.get_device_properties(dev)
bus = f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
allowed = os.sched_getaffinity(0)
nodes = {}
for name in sorted(os.listdir("/sys/devices/system/node")) if os.path.isdir("/sys/devices/system/node") else []:
    if name.startswith("node") and name[4:].isdigit():
        nodes[int(name[4:])] = sorted(cpulist(read(f"/sys/devices/system/node/{name}/cpulist")) & allowed)
machine = {"pci": bus, "gpu_numa_node": read(f"/sys/bus/pci/devices/{bus}/numa_node"),
           "gpu_local_cpus": read(f"/sys/bus/pci/devices/{bus}/local_cpulist"), "allowed": sorted(allowed),
           "nodes_allowed": nodes, "nproc": os.cpu_count()}
try:
    machine["topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
except Exception as exc:
    machine["topo"] = repr(exc)
print(json.dumps({k: v for k, v in machine.items() if k != "topo"}))
print(machine["topo"])


def between_buckets() -> None:
    x = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    del x
    torch.cuda.empty_cache()
    torch.cuda.synchronize()


def rounds(n: int) -> list[dict]:
    out = []
    for _ in range(n):
        between_buckets()
        before = cpu()
        p = timing.host_probe(dev) * 1e6
        out.append({"cpu_before": before, "cpu_after": cpu(), "probe_us": p})
    return out


spec = AttentionSpec(32, 8, 128, "bf16", 16)
triton = backends.get("triton")
plan_args, sets = timing.rotated_workloads(spec, "decode", (4, 256), dev)
run = triton.plan_decode(spec, *plan_args)
run(*sets[0])


def triton_us(n: int = 15) -> list[float]:
    """CUDA-event us per call of 200 calls, n samples (host-bound: launches are the time)."""
    res = []
    for _ in range(n):
        between_buckets()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(200):
            run(*sets[i % len(sets)])
        e.record()
        e.synchronize()
        res.append(s.elapsed_time(e) * 1e3 / 200)
    return res


results = {"machine": machine, "settings": {}}
results["settings"]["unpinned"] = {"rounds": rounds(300), "triton_us": triton_us()}
pins = {}
local = sorted(cpulist(machine["gpu_local_cpus"]) & allowed)
if local and set(local) != allowed:
    pins["gpu-local"] = local
for node, cpus in nodes.items():
    if cpus:
        pins[f"node{node}"] = cpus
        pins[f"cpu{cpus[len(cpus) // 2]}"] = [cpus[len(cpus) // 2]]
if len(pins) <= 2:  # one node: pin to single CPUs across the allowed set
    for c in sorted(allowed)[:: max(1, len(allowed) // 4)]:
        pins[f"cpu{c}"] = [c]
for name, cpus in pins.items():
    os.sched_setaffinity(0, cpus)
    results["settings"][name] = {"cpus": cpus, "rounds": rounds(100), "triton_us": triton_us()}
os.sched_setaffinity(0, allowed)

fastest = min(r["probe_us"] for s in results["settings"].values() for r in s["rounds"])
for name, s in results["settings"].items():
    probes = sorted(r["probe_us"] for r in s["rounds"])
    q = statistics.quantiles(probes, n=10)
    slow = sum(p >= 1.2 * fastest for p in probes) / len(probes)
    tri = sorted(s["triton_us"])
    print(f"{name:12s} probe median {statistics.median(probes):.2f} p10 {q[0]:.2f} p90 {q[-1]:.2f} us, "
          f"{slow:.0%} >= 1.2x fastest ({fastest:.2f}); triton 4x256 median {statistics.median(tri):.1f} "
          f"min {tri[0]:.1f} max {tri[-1]:.1f} us; cpus {s.get('cpus', 'all')[:8] if 'cpus' in s else 'all'}")
by_cpu: dict[int, list[float]] = {}
for r in results["settings"]["unpinned"]["rounds"]:
    by_cpu.setdefault(r["cpu_before"], []).append(r["probe_us"])
print("unpinned, probe median per CPU:", {c: (len(v), round(statistics.median(v), 2)) for c, v in sorted(by_cpu.items())})
moved = sum(r["cpu_before"] != r["cpu_after"] for r in results["settings"]["unpinned"]["rounds"])
print(f"unpinned: {moved} of 300 probes moved CPU during the probe")
with open(out_path, "w") as f:
    json.dump(results, f)
