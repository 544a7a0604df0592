"""Branch layers against their protocols (`longstraw/kinds/base.py`): every branch-layer class is a `BranchLayer`, the
latent ones a `LatentBranch`, every attention layer attends its prompt itself, and a latent layer's `attend_latent` /
`select_keys` read the prompt where it lives (locally, or across the ranks with `CollectiveAttention` /
`CollectiveSparseAttention`). Classes are checked by their class attributes (the protocols' data members have class-level
defaults), and the branch of every registered layer kind as an instance."""

import importlib
import inspect
import pkgutil
import sys
from types import SimpleNamespace

import pytest
from typing_extensions import get_protocol_members, is_protocol  # in `typing` from Python 3.13

import longstraw.distributed.context_parallel
import longstraw.kinds
from longstraw.distributed.context_parallel.full_attention import ReplayBranchLayer
from longstraw.kinds import AttentionBranchLayer, MixerlessBranchLayer
from longstraw.kinds.base import (
    BranchLayer,
    CollectiveAttention,
    CollectiveSparseAttention,
    LatentBranch,
    PromptBranchLayer,
    layer_kind,
    registered_layer_types,
)
from longstraw.kinds.latent_attention import LatentOwn

#: the packages whose modules define branch layers: the layer kinds and the context-parallel ones
PACKAGES = (longstraw.kinds, longstraw.distributed.context_parallel)


def branch_layer_classes() -> dict[str, type]:
    """Every concrete class named `*BranchLayer` defined in a module of `PACKAGES` (the protocols aside), by module and
    name."""
    found = {}
    for package in PACKAGES:
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for name, cls in vars(module).items():
                if (
                    inspect.isclass(cls)
                    and name.endswith("BranchLayer")
                    and cls.__module__ == module.__name__
                    and not inspect.isabstract(cls)
                    and not is_protocol(cls)
                ):
                    found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


CLASSES = branch_layer_classes()


def missing(cls: type, protocol: type) -> list[str]:
    """The members of `protocol` that `cls` lacks as a class attribute (method, property or declared default)."""
    return sorted(m for m in get_protocol_members(protocol) if not hasattr(cls, m))


def test_the_classes_are_found():
    names = {cls.__name__ for cls in CLASSES.values()}
    assert {
        "AttentionBranchLayer",
        "CompressedBranchLayer",
        "HybridBranchLayer",
        "LatentBranchLayer",
        "RecurrentBranchLayer",
        "MixerlessBranchLayer",
        "CaptureBranchLayer",
        "ReplayBranchLayer",
        "SampleBranchLayer",
        "SlidingCaptureBranchLayer",
        "LatentCaptureBranchLayer",
        "DsaReplayBranchLayer",
    } <= names

    # every concrete attention-like branch layer is named as the others are, so none escapes the checks below
    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    # classes a module of the package defines (a test's own subclass, made in another test, is no module's)
    prompt_layers = {
        c
        for c in subclasses(PromptBranchLayer)
        if c.__module__.startswith("longstraw.") and getattr(sys.modules[c.__module__], c.__qualname__, None) is c
    }
    assert {c for c in prompt_layers if not inspect.isabstract(c)} <= set(CLASSES.values())


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_every_branch_layer_class_is_a_branch_layer(name):
    assert missing(CLASSES[name], BranchLayer) == []


@pytest.mark.parametrize("name", sorted(n for n, c in CLASSES.items() if issubclass(c, LatentOwn)))
def test_latent_branch_layers_offer_what_latent_attention_reads(name):
    assert missing(CLASSES[name], LatentBranch) == []


def prompt_reading_faults(cls: type) -> list[str]:
    """What is wrong with how `cls` reads its prompt part: an attention branch layer without `attend`; a
    context-parallel latent layer (no local prompt) that keeps `LatentOwn`'s local attention, or a DSA one (with
    `attend_sparse`) its local selection; a local latent layer that does not."""
    faults = []
    if issubclass(cls, AttentionBranchLayer) and missing(cls, CollectiveAttention):
        faults.append("an attention branch layer without `attend`")
    if issubclass(cls, LatentOwn):
        distributed = cls.__module__.startswith("longstraw.distributed.")
        if (cls.attend_latent is LatentOwn.attend_latent) == distributed:
            faults.append("attend_latent " + ("local in a context-parallel layer" if distributed else "overridden"))
        sparse = missing(cls, CollectiveSparseAttention) == []
        if (cls.select_keys is LatentOwn.select_keys) == (distributed and sparse):
            faults.append("select_keys local in a context-parallel DSA layer" if distributed else "select_keys overridden")
    return faults


@pytest.mark.parametrize("name", sorted(n for n, c in CLASSES.items() if issubclass(c, PromptBranchLayer)))
def test_each_layer_reads_its_prompt_where_it_lives(name):
    """Every attention branch layer attends its prompt part itself (`attend`: locally, or across the ranks); a latent
    layer's `attend_latent` / `select_keys` are the local ones exactly in the layers that hold the prompt locally."""
    assert prompt_reading_faults(CLASSES[name]) == []


@pytest.mark.parametrize("layer_type", sorted(registered_layer_types()))
def test_every_kind_branches_into_a_branch_layer(layer_type):
    config = SimpleNamespace(
        sliding_window=4, attention_chunk_size=4, layer_types=[layer_type], compress_rates={layer_type: 4}
    )
    state = layer_kind(layer_type)(config, 0, 8)
    for batch in (1, 3):
        layer = state.branch(batch)
        assert isinstance(layer, BranchLayer)
        assert type(layer) in CLASSES.values()


def test_the_checks_catch_a_missing_member_and_a_local_read():
    """The checks above on planted classes: one without `get_max_length`; a context-parallel latent layer that forgot
    to read its prompt across the ranks (it would attend an absent local prompt)."""
    members = {k: v for k, v in vars(MixerlessBranchLayer).items() if not k.startswith("__")}
    assert missing(type("Complete", (), members), BranchLayer) == []
    del members["get_max_length"]
    stripped = type("Stripped", (), members)
    assert missing(stripped, BranchLayer) == ["get_max_length"]
    assert not isinstance(stripped(), BranchLayer)

    real = CLASSES["longstraw.distributed.context_parallel.latent_attention.DsaReplayBranchLayer"]
    assert prompt_reading_faults(real) == []
    forgot = type("Forgot", (LatentOwn, ReplayBranchLayer), {"__module__": real.__module__})
    assert prompt_reading_faults(forgot) == ["attend_latent local in a context-parallel layer"]
