"""Hypothesis strategies shared by the needs and machine tests."""

from __future__ import annotations

from hypothesis import strategies as st

from bigfleet.needs import (
    MAX_MILLI,
    Need,
    Operator,
    PenaltyBucket,
    Profile,
    Requirement,
    Resources,
    TopologySpread,
    WhenUnsatisfiable,
)

RESOURCE_NAMES = ["cpu", "memory", "nvidia.com/gpu", "ephemeral-storage", "example.com/fpga"]
label_text = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-._", min_size=1, max_size=12)
label_keys = st.sampled_from(
    ["zone", "topology.kubernetes.io/zone", "node.kubernetes.io/instance-type", "pool", "arch", "gpu"]
) | label_text

milli = st.integers(min_value=0, max_value=MAX_MILLI // 64)
resources = st.dictionaries(st.sampled_from(RESOURCE_NAMES), milli, max_size=5).map(Resources.from_milli)


@st.composite
def requirements(draw: st.DrawFn) -> Requirement:
    op = draw(st.sampled_from([o for o in Operator if o is not Operator.UNSPECIFIED]))
    if op in (Operator.EXISTS, Operator.DOES_NOT_EXIST):
        values: list[str] = []
    elif op is Operator.SAME:
        values = draw(st.lists(label_text, max_size=3))
    else:
        values = draw(st.lists(label_text, min_size=1, max_size=4))
    return Requirement(draw(label_keys), op, tuple(values))


spreads = st.builds(
    TopologySpread,
    label_keys,
    st.integers(min_value=1, max_value=10),
    st.sampled_from(list(WhenUnsatisfiable)),
)

profiles = st.builds(
    Profile,
    st.lists(requirements(), max_size=4).map(tuple),
    st.lists(spreads, max_size=2).map(tuple),
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.sampled_from(list(PenaltyBucket)),
    st.sampled_from(list(PenaltyBucket)),
    st.sampled_from(["", "gang-a", "gang-b"]),
)


def needs_for(cluster: str) -> st.SearchStrategy[Need]:
    return st.builds(Need, st.just(cluster), profiles, resources, resources, st.integers(min_value=0, max_value=2**62))
