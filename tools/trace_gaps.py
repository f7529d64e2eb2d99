"""Where a GPU trace waits for the host: ``python tools/trace_gaps.py TRACE [--steps N] [--top K]``.

TRACE is a ``trainer.profile`` Chrome trace (``<run_dir>/profile/trace_rank0.json.gz``). Every gap
between the GPU's kernels and copies is the GPU idling; where the kernel that ends a gap was
launched after the gap began, the GPU waited for the host, and the CPU events running on the
launching thread during that wait are what the host was doing. Prints, per recorded step: the
idle time, the part spent waiting for a launch, and that part split by the CPU events it
overlapped (top-level events such as a compiled region or the autograd engine's call of a
compiled backward, then their children, then the innermost events), and the longest
synchronizing calls. A ``breakdown_rank<r>.json`` says how much is idle; this says why.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
from pathlib import Path

GPU = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH = ("cuda_runtime", "cuda_driver")
CPU = ("cpu_op", "user_annotation", "python_function", *LAUNCH)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaMemcpyAsync")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


class HostThreads:
    """The CPU events of each thread as a forest (each event's parent: the event enclosing it)."""

    def __init__(self, events: list[dict]) -> None:
        self.events: dict[int, list[dict]] = collections.defaultdict(list)
        for e in events:
            if e.get("cat") in CPU:
                self.events[e["tid"]].append(e)
        self.starts, self.has_child = {}, set()
        for tid, es in self.events.items():
            es.sort(key=lambda e: (e["ts"], -e["dur"]))
            open_events: list[dict] = []
            for e in es:
                while open_events and open_events[-1]["ts"] + open_events[-1]["dur"] <= e["ts"]:
                    open_events.pop()
                e["parent"] = open_events[-1] if open_events else None
                if e["parent"] is not None:
                    self.has_child.add(id(e["parent"]))
                open_events.append(e)
            self.starts[tid] = [e["ts"] for e in es]

    def overlapping(self, tid: int, lo: float, hi: float) -> list[dict]:
        """Events of ``tid`` overlapping ``[lo, hi)``: those open at ``lo`` and those starting inside."""
        es, starts = self.events[tid], self.starts[tid]
        i = bisect.bisect_left(starts, lo)
        found = {id(e): e for e in es[i : bisect.bisect_left(starts, hi)]}
        # open at lo: the last event to start before it and its ancestors (any event open at lo
        # started before that one and is still open after its start, so it encloses it)
        e = es[i - 1] if i else None
        while e is not None:
            if e["ts"] + e["dur"] > lo:
                found[id(e)] = e
            e = e["parent"]
        return list(found.values())


def chain(e: dict) -> list[str]:
    """The names from the outermost enclosing event to ``e``, profiler step markers left out."""
    names = []
    while e is not None:
        if not e["name"].startswith("ProfilerStep"):
            names.append(e["name"])
        e = e["parent"]
    return names[::-1]


def analyse(events: list[dict], steps: int) -> dict:
    """Per step (ms): ``idle``, ``waiting_for_launch`` and the waits by overlapping CPU event
    (``top_level``, ``second_level``, ``innermost``); ``syncs``: synchronizing calls over 20 us."""
    gpu = sorted((e for e in events if e.get("cat") in GPU), key=lambda e: e["ts"])
    launches = {
        e["args"]["correlation"]: e for e in events if e.get("cat") in LAUNCH and "correlation" in e.get("args", {})
    }
    host = HostThreads(events)
    waits = {
        "top_level": collections.Counter(),
        "second_level": collections.Counter(),
        "innermost": collections.Counter(),
    }
    idle = waiting = 0.0
    gaps = 0
    busy_until = gpu[0]["ts"] + gpu[0]["dur"] if gpu else 0.0
    for k in gpu[1:]:
        if k["ts"] > busy_until:
            idle += k["ts"] - busy_until
            launch = launches.get(k.get("args", {}).get("correlation"))
            end = min(launch["ts"], k["ts"]) if launch else busy_until
            if end > busy_until:
                waiting += end - busy_until
                gaps += 1
                for e in host.overlapping(launch["tid"], busy_until, end):
                    overlap = min(e["ts"] + e["dur"], end) - max(e["ts"], busy_until)
                    names = chain(e)
                    if overlap <= 0 or not names:
                        continue
                    if len(names) == 1:
                        waits["top_level"][names[0]] += overlap
                    elif len(names) == 2:
                        waits["second_level"][" > ".join(names)] += overlap
                    if id(e) not in host.has_child:
                        waits["innermost"][f"{names[0]} > ... > {names[-1]}" if len(names) > 1 else names[0]] += overlap
        busy_until = max(busy_until, k["ts"] + k["dur"])
    syncs = collections.Counter()
    for es in host.events.values():
        for e in es:
            if e["name"] in SYNCS and e["dur"] > 20:
                syncs[" > ".join(chain(e)[-3:])] += e["dur"]
    per_step = lambda us: round(us / 1000 / max(steps, 1), 3)  # noqa: E731
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"] if gpu else 0.0
    return {
        "span": per_step(span),
        "idle": per_step(idle),
        "waiting_for_launch": per_step(waiting),
        "gaps_waiting_for_launch": round(gaps / max(steps, 1), 1),
        **{kind: {name: per_step(us) for name, us in c.most_common()} for kind, c in waits.items()},
        "syncs": {name: per_step(us) for name, us in syncs.most_common()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=5, help="steps the trace records (trainer.profile.steps)")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    r = analyse(load(args.trace), args.steps)
    print(
        f"per step: GPU span {r['span']} ms, idle {r['idle']} ms, waiting for a launch {r['waiting_for_launch']} ms "
        f"({r['gaps_waiting_for_launch']} gaps)"
    )
    for kind in ("top_level", "second_level", "innermost", "syncs"):
        print(f"\n{kind.replace('_', ' ')} (ms per step)")
        for name, ms in list(r[kind].items())[: args.top]:
            print(f"{ms:9.3f}  {name[:140]}")


if __name__ == "__main__":
    main()
