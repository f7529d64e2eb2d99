"""The versions of torch, FBGEMM, TorchRec and Triton, checked against combinations known to work.

FBGEMM's operators are compiled against one torch release, TorchRec against one FBGEMM release and
torch's Inductor against one Triton release; a mismatched set fails late and obscurely (an
undefined symbol when ``fbgemm_gpu`` loads, an operator missing inside TorchRec's sharding, a
kernel that does not compile). This module compares the installed distributions (their metadata
only: nothing is imported) with :data:`KNOWN_GOOD` and with the pairing rules, once per process,
before gem.data and gem.sparse import TorchRec:

- FBGEMM ``1.X`` pairs with torch ``2.(X+5)`` (fbgemm-gpu 1.6 / torch 2.11, 1.8 / 2.13);
- TorchRec ``1.X`` pairs with FBGEMM ``1.X``;
- for a torch release in the table, Triton is the release it was tested with.

A combination that breaks a rule (or lacks a package) raises :class:`VersionError`, naming the
installed versions and a combination to install; one that keeps the rules but is not in the
table warns once. ``GEM_SKIP_VERSION_CHECK=1`` skips the check for users who know better.
"""

from __future__ import annotations

import functools
import os
import re
import warnings
from dataclasses import dataclass
from importlib import metadata

SKIP_ENV = "GEM_SKIP_VERSION_CHECK"
FBGEMM_BUILDS = ("fbgemm-gpu", "fbgemm-gpu-cpu")  # the CUDA build and the CPU build of one package
TORCH_MINUS_FBGEMM = 5  # FBGEMM 1.X pairs with torch 2.(X+5)


class VersionError(ImportError):
    """The installed torch / FBGEMM / TorchRec / Triton do not fit together; the message says what to install."""


@dataclass(frozen=True)
class Combination:
    """One set of releases known to work (major, minor), with the pins to install it."""

    torch: tuple[int, int]
    fbgemm: tuple[int, int]
    torchrec: tuple[int, int]
    triton: tuple[int, int]
    cpu: str  # pip command for the CPU builds
    cuda: str  # pip command for the CUDA builds
    cpu_where: str  # where each was run
    cuda_where: str

    @property
    def triton_pin(self) -> str:
        """The exact Triton release of the CPU install string (``"3.6.0"``), which the sm_90
        compile check builds the kernels with (Makefile, tests/kernels/test_jagged_attention.py)."""
        pin = re.search(r"\btriton==(\S+)", self.cpu)
        if pin is None or release(pin[1]) != self.triton:
            raise ValueError(f"no triton=={self.triton[0]}.{self.triton[1]}.* in {self.cpu!r}")
        return pin[1]

    def matches(self, v: dict[str, tuple[int, int] | None]) -> bool:
        return (v["torch"], v["fbgemm"], v["torchrec"], v["triton"]) == (
            self.torch,
            self.fbgemm,
            self.torchrec,
            self.triton,
        )


KNOWN_GOOD = (
    Combination(
        (2, 13),
        (1, 8),
        (1, 8),
        (3, 7),
        cpu="pip install torch==2.13.0 fbgemm-gpu-cpu==1.8.0 triton==3.7.1 && pip install --no-deps torchrec==1.8.0",
        cuda="pip install torch==2.13.0 fbgemm-gpu==1.8.0 torchrec==1.8.0 triton==3.7.1",
        cpu_where="the CPU pins of requirements-cpu.txt, which CI runs",
        cuda_where="the CUDA builds of the CPU pins; not yet run on a GPU by gem",
    ),
    Combination(
        (2, 11),
        (1, 6),
        (1, 6),
        (3, 6),
        cpu="pip install torch==2.11.0 fbgemm-gpu-cpu==1.6.0 triton==3.6.0 && pip install --no-deps torchrec==1.6.1",
        cuda="pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130 && "
        "pip install fbgemm-gpu==1.6.0 torchrec==1.6.1 triton==3.6.0",
        cpu_where="the CPU build of fbgemm-gpu on an H200 machine",
        cuda_where="one H200 with CUDA 13.0, docs/distributed.md",
    ),
)


def release(version: str | None) -> tuple[int, int] | None:
    """``"2.11.0+cu130"`` -> ``(2, 11)``; ``"2.14.0.dev20260101"`` -> ``(2, 14)``; None stays None."""
    if version is None:
        return None
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def installed() -> dict[str, str | None]:
    """The installed version of each distribution gem checks (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in ("torch", *FBGEMM_BUILDS, "torchrec", "triton", "pytorch-triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["triton"] = out["triton"] or out.pop("pytorch-triton")  # torch's nightlies ship it as pytorch-triton
    out.pop("pytorch-triton", None)
    return out


def _fbgemm(found: dict[str, str | None]) -> tuple[str, str | None]:
    """The FBGEMM build in use and its version: the CUDA build when both are installed (a CUDA wheel
    installed over the CPU one, as tools/fbgemm_gpu_parts.sh does, shadows it)."""
    for name in FBGEMM_BUILDS:
        if found.get(name):
            return name, found[name]
    return "fbgemm-gpu-cpu" if "+cpu" in (found.get("torch") or "") else "fbgemm-gpu", None


def _describe(found: dict[str, str | None]) -> str:
    build, _ = _fbgemm(found)
    names = ["torch", *(n for n in FBGEMM_BUILDS if found.get(n)), "torchrec", "triton"]
    if not any(found.get(n) for n in FBGEMM_BUILDS):
        names.insert(1, build)
    return ", ".join(f"{n} {found.get(n) or '(not installed)'}" for n in names)


def _suggestion(found: dict[str, str | None]) -> str:
    """A known-good combination to install: the one with the installed torch when there is one
    (only the other packages change), else the newest; in the installed build (CPU or CUDA)."""
    torch = release(found.get("torch"))
    combo = next((c for c in KNOWN_GOOD if c.torch == torch), KNOWN_GOOD[0])
    build, _ = _fbgemm(found)
    cpu = build == "fbgemm-gpu-cpu"
    return f"`{combo.cpu if cpu else combo.cuda}` ({combo.cpu_where if cpu else combo.cuda_where})"


def check_versions(found: dict[str, str | None] | None = None) -> str | None:
    """Check ``found`` (default: :func:`installed`); raise :class:`VersionError` for a combination
    that breaks the pairing rules, return a warning for one that keeps them but is untested, None
    for a known-good one."""
    found = installed() if found is None else found
    build, fbgemm_version = _fbgemm(found)
    v = {
        "torch": release(found.get("torch")),
        "fbgemm": release(fbgemm_version),
        "torchrec": release(found.get("torchrec")),
        "triton": release(found.get("triton")),
    }
    if any(c.matches(v) for c in KNOWN_GOOD):
        return None
    problems = []
    for key, name in (("torch", "torch"), ("fbgemm", build), ("torchrec", "torchrec"), ("triton", "triton")):
        if v[key] is None:
            problems.append(f"{name} is not installed")
    if v["torch"] and v["fbgemm"] and v["fbgemm"][1] + TORCH_MINUS_FBGEMM != v["torch"][1]:
        wanted = f"{v['fbgemm'][0]}.{v['torch'][1] - TORCH_MINUS_FBGEMM}"
        problems.append(
            f"{build} {fbgemm_version} is built for torch 2.{v['fbgemm'][1] + TORCH_MINUS_FBGEMM}, not "
            f"{found['torch']} (FBGEMM 1.X pairs with torch 2.(X+5): {build} {wanted} for this torch)"
        )
    if v["fbgemm"] and v["torchrec"] and v["torchrec"] != v["fbgemm"]:
        problems.append(
            f"torchrec {found['torchrec']} pairs with FBGEMM {v['torchrec'][0]}.{v['torchrec'][1]}, "
            f"not {build} {fbgemm_version}"
        )
    tested = next((c for c in KNOWN_GOOD if c.torch == v["torch"]), None)
    if tested and v["triton"] and v["triton"] != tested.triton:
        problems.append(
            f"torch {found['torch']} was tested with triton {tested.triton[0]}.{tested.triton[1]}, "
            f"not {found['triton']}"
        )
    if problems:
        raise VersionError(
            f"these versions do not work together: {'; '.join(problems)} (installed: "
            f"{_describe(found)}). Install a combination known to work: {_suggestion(found)}; or set "
            f"{SKIP_ENV}=1 to skip this check"
        )
    known = "; ".join(
        f"torch {c.torch[0]}.{c.torch[1]} + FBGEMM {c.fbgemm[0]}.{c.fbgemm[1]} + torchrec "
        f"{c.torchrec[0]}.{c.torchrec[1]} + triton {c.triton[0]}.{c.triton[1]}"
        for c in KNOWN_GOOD
    )
    return (
        f"gem has not been tested with {_describe(found)} (the pairing rules hold; known to work: {known}); "
        f"set {SKIP_ENV}=1 to silence this warning"
    )


@functools.cache
def ensure_versions() -> None:
    """:func:`check_versions` once per process (skipped with ``GEM_SKIP_VERSION_CHECK=1``); an
    untested combination warns once."""
    if os.environ.get(SKIP_ENV) == "1":
        return
    warning = check_versions()
    if warning:
        warnings.warn(warning, stacklevel=2)
