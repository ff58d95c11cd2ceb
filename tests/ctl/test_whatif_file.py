"""`bigfleetctl whatif -f`: the file shapes it reads (CapacityRequests, a List of them, or a
ClusterCapacityNeeds document) and the usage errors it gives."""

from __future__ import annotations

import pytest

from bigfleet.ctl.shardcmds import UsageError
from bigfleet.ctl.whatif import load

CR = """\
apiVersion: bigfleet.lucy.sh/v1alpha1
kind: CapacityRequest
metadata: {{name: {name}, namespace: shop}}
spec: {{priority: {prio}, resources: {{cpu: "{cpu}"}}}}
"""


def test_capacity_requests_fold_like_the_operator() -> None:
    text = "---\n".join([CR.format(name="a", prio=100, cpu=1), CR.format(name="b", prio=100, cpu=2),
                         CR.format(name="c", prio=5, cpu=1)])
    c = load(text, "c1")
    assert c.cluster_id == "c1" and len(c.needs) == 2
    assert c.needs[0].aggregate_resources["cpu"] == "3" and c.needs[0].min_unit["cpu"] == "2"
    assert c.crs == {0: ["shop/a", "shop/b"], 1: ["shop/c"]}
    listed = load("kind: List\nitems:\n" + "".join("- " + line + "\n" if i == 0 else "  " + line + "\n"
                                                   for i, line in enumerate(CR.format(name="a", prio=1, cpu=1).splitlines())), "c1")
    assert len(listed.needs) == 1
    bad = load(CR.format(name="a", prio=1, cpu="lots"), "c1")
    assert bad.needs == [] and "shop/a" in bad.skipped[0]


def test_cluster_capacity_needs_document() -> None:
    c = load("clusterId: c9\nneeds:\n- aggregateResources: {cpu: '2'}\n  priority: 7\n", "")
    assert c.cluster_id == "c9" and c.needs[0].priority == 7 and c.crs == {}


@pytest.mark.parametrize(("text", "cluster", "why"), [
    (CR.format(name="a", prio=1, cpu=1), "", "--cluster"),
    ("needs: []\n", "", "--cluster"),
    ("clusterId: a\nneeds: []\n", "b", "clusterId"),
    ("needs: [{bogus: 1}]\n", "c1", "ClusterCapacityNeeds"),
    (": :\n", "c1", "not YAML"),
    ("- 1\n", "c1", "mapping"),
    (CR.format(name="a", prio=1, cpu=1) + "---\nneeds: []\n", "c1", "mix"),
])
def test_usage_errors(text: str, cluster: str, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        load(text, cluster)
