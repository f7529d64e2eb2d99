"""The jagged attention kernels' switches: one frozen object, built once and handed down.

Every switch has one default (the dataclass below) and may be set by the run's config
(``configs/kernels/*.yaml`` and ``experimental.kernels``). The trainer turns the config into one
object with :func:`resolve` and hands it to the model's attention modules
(``gem.models.sequence.use_kernel_settings``), which pass it to each call
(``jagged_attention(..., settings=...)``); a call without settings takes the process default,
:func:`current`. A few may be overridden for debugging by a ``GEM_KERNELS_*`` environment variable
(:data:`ENV`), in any process, with a warning where it changes what the config set. The
measurements behind each default are in docs/log/kernels.md.

    from kernels.jagged_attention import settings
    mine = settings.resolve(store_ds=False)       # defaults, these values, the environment
    jagged_attention(q, k, v, ..., settings=mine)
"""

from __future__ import annotations

import dataclasses
import os
import warnings

TUNE_SPACES = ("default", "wide")


@dataclasses.dataclass(frozen=True)
class KernelSettings:
    """The switches (docs/kernels.md, "Settings").

    Attributes:
        check: check offsets and max lengths on the device too (a device-to-host copy, so a sync,
            per call: for debugging); ``jagged_attention(check=...)`` overrides it per call.
        autotune: time a few configs per bucketed shape key (GPU); off, each kernel launches its
            per-head-dim default config.
        tune_space: ``"default"`` or ``"wide"`` (about three times the tuning time at each new
            shape bucket; for benchmarks and for choosing the default list).
        packed_act: bf16 silu / fast_gelu run on bf16x2 pairs (sm_90+); off, float32 math.
        gluon: the GDPA forward without a mask runs the persistent, warp-specialized Gluon kernel
            (sm_90, eager calls) where ``max_q_len > gluon_min_q_len``.
        gluon_min_q_len: the Gluon forward runs above this ``max_q_len`` (the Triton forward was
            faster at 128 rows).
        gluon_bwd: the stored-dS backward's dK/dV runs the Gluon kernel (sm_90, bf16 silu and
            fast_gelu on the bf16x2 path).
        store_ds: without a causal, window or block mask and without a broadcast Q, the dK/dV
            kernel stores dS and dQ = dS K reads it instead of recomputing S and dP.
        store_ds_max_mib: the stored-dS buffer's cap in MiB; above it dQ is recomputed.
        rotary_fused: :func:`kernels.jagged_attention.rotary_self_attention` runs its fused
            kernels (V read from the packed projection, its gradient written whole); off, it
            runs the rotary kernel and then :func:`jagged_attention`. Less GPU time (gem_base
            InterFormer: -1.3 ms a step), two ``[T, H, D]`` tensors a layer more kept for the
            backward; on in ``experiment=gem_base_h200`` (docs/kernels.md).
        gluon_compiled: under ``torch.compile``, attention with a pointwise activation and no mask
            (GDPA, the personalized FFN) runs as an opaque op that launches its kernels itself, so
            that the Gluon kernels run there too (Inductor launches only Triton kernels); meant
            for CUDA graphs, which take away the launches' host time. Not yet measured: off.
        generated_weights: under ``torch.compile`` with the Triton backend, the personalized FFN's
            generated K/V (``gem.models.sequence.generate_weights``) take their three gradients
            from one read of the gradient (:mod:`kernels.generated_weights`); off, a sum over the
            batch and two GEMMs, three reads (docs/kernels.md).
    """

    check: bool = False
    autotune: bool = True
    tune_space: str = "default"
    packed_act: bool = True
    gluon: bool = True
    gluon_min_q_len: int = 128
    gluon_bwd: bool = True
    store_ds: bool = True
    store_ds_max_mib: int = 8192
    rotary_fused: bool = False
    gluon_compiled: bool = False
    generated_weights: bool = True

    @property
    def store_ds_max_bytes(self) -> int:
        return self.store_ds_max_mib << 20

    def replace(self, **values) -> KernelSettings:
        """A copy with ``values`` changed, each checked (a bad one raises naming its key)."""
        return KernelSettings(**(dataclasses.asdict(self) | _checked(values, source="key")))


# The settings an environment variable overrides, for debugging (docs/kernels.md, "Settings"):
# checking offsets, fixed launch configs or a wider search, the Gluon kernels off.
ENV = {name: "GEM_KERNELS_" + name.upper() for name in ("check", "autotune", "tune_space", "gluon")}
_TYPES = {field.name: field.type for field in dataclasses.fields(KernelSettings)}
# Settings that were measured and deleted (docs/log/kernels.md): naming one is an error that says so.
DELETED = {
    "gluon_bwd_softmax": "deleted on 2026-12-07: the Gluon softmax dK/dV was no faster end to end "
    "(docs/log/kernels.md); the softmax backward runs the Triton dK/dV",
}
_TRUE, _FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")

_current: KernelSettings | None = None


def _parse(name: str, text: str, kind: str, label: str):
    """A setting's value from its text in the environment; the error names ``label``."""
    value = text.strip().lower()
    if kind == "bool":
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{label}={text!r}: expected 1 or 0 (also true / false, on / off, yes / no)")
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise ValueError(
                f"{label}={text!r}: expected a whole number, e.g. {getattr(KernelSettings, name)}"
            ) from None
    return value


def _check(name: str, value, label: str):
    """``value`` if it is a valid ``name``; else a ValueError naming ``label``."""
    kind = _TYPES[name]
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{label}={value!r}: expected true or false")
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{label}={value!r}: expected a whole number >= 0")
    if name == "tune_space" and value not in TUNE_SPACES:
        raise ValueError(f"{label}={value!r}: expected one of {', '.join(TUNE_SPACES)}")
    return value


def deleted(name: str, label: str) -> str:
    """The error message for the deleted setting ``name``, named as ``label`` (a config key or a
    variable)."""
    return f"{label}: the kernel setting {name} was {DELETED[name]}; remove it"


def _checked(values: dict, source: str) -> dict:
    for name in sorted(set(values) & set(DELETED)):
        raise ValueError(deleted(name, f"kernels.{name}"))
    unknown = sorted(set(values) - set(_TYPES))
    if unknown:
        raise ValueError(f"unknown kernel setting(s) {unknown}; expected some of {sorted(_TYPES)}")
    return {name: _check(name, value, f"kernels.{name}") for name, value in values.items()}


def from_environment(base: KernelSettings | None = None) -> KernelSettings:
    """``base`` (the defaults if None) with every ``GEM_KERNELS_*`` variable that is set and not
    empty applied; a bad value raises naming the variable."""
    base = base or KernelSettings()
    for name in sorted(DELETED):
        variable = "GEM_KERNELS_" + name.upper()
        if os.environ.get(variable, "").strip():
            raise ValueError(deleted(name, variable))
    for variable in sorted(set(os.environ) - set(ENV.values())):
        if variable.startswith("GEM_KERNELS_") and os.environ[variable].strip():
            name = variable.removeprefix("GEM_KERNELS_").lower()
            where = f"the config key kernels.{name} (or experimental.kernels.{name})" if name in _TYPES else "nothing"
            warnings.warn(
                f"{variable} is not read (the debugging variables: {', '.join(ENV.values())}); it maps to {where}",
                stacklevel=3,
            )
    values = {}
    for name, variable in ENV.items():
        text = os.environ.get(variable, "")
        if text.strip():
            values[name] = _check(name, _parse(name, text, _TYPES[name], variable), variable)
    return dataclasses.replace(base, **values)


def resolve(**values) -> KernelSettings:
    """The kernels' settings of a run: the defaults, then ``values`` (config keys, e.g.
    ``store_ds=False``; a bad one raises naming ``kernels.<key>``), then the environment's
    debugging overrides, each with a warning where it changes a value given here."""
    configured = KernelSettings().replace(**values)
    resolved = from_environment(configured)
    for name, variable in ENV.items():
        if name in values and getattr(resolved, name) != getattr(configured, name):
            warnings.warn(
                f"{variable} overrides kernels.{name}={getattr(configured, name)!r} with "
                f"{getattr(resolved, name)!r} (a debugging switch: unset it to use the config)",
                stacklevel=2,
            )
    return resolved


def configure(**values) -> KernelSettings:
    """Sets the process default (:func:`current`) to :func:`resolve` ``(**values)`` and returns it:
    for direct users of the kernels. (Deprecated for runs: the trainer no longer calls it, it hands
    its settings to the model.)"""
    global _current
    _current = resolve(**values)
    return _current


def current() -> KernelSettings:
    """The process default: the settings of a call that is given none (built on the first call
    from the defaults and the environment, unless :func:`configure` ran)."""
    return _current if _current is not None else configure()


def build_flags(settings: KernelSettings) -> tuple[bool, str, bool, bool]:
    """What of a call's ``settings`` its Triton kernels' build check must share with it (the launch
    configs, the activation's path, the dQ kernel): ``(autotune, tune_space, packed_act, store_ds)``,
    as constants Dynamo keeps (``triton_common.resolve_backend``)."""
    return settings.autotune, settings.tune_space, settings.packed_act, settings.store_ds


def triton_only(autotune: bool, tune_space: str, packed_act: bool, store_ds: bool) -> KernelSettings:
    """The settings of a Triton build check (``probes.py``): the call's :func:`build_flags`, the
    Gluon kernels off."""
    return KernelSettings(
        autotune=autotune, tune_space=tune_space, packed_act=packed_act, store_ds=store_ds, gluon=False, gluon_bwd=False
    )


def _set(value: KernelSettings) -> None:
    """Installs ``value`` as is (no environment applied): for ``testing.override``."""
    global _current
    _current = value
