"""The dashboard in headless Chromium against a real fleet: the page loads without console errors
and the numbers it shows match the shard's and coordinator's APIs.

Needs Debian's `chromium` (`make browser-deps`, run by `make install` where apt-get works) and the
`playwright` Python package (dev extra; its bundled driver, never `playwright install`). Skips,
saying why, when either is missing."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dashboard.fleet import Fleet, running_fleet

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (run `make browser-deps` as root)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    profile = tempfile.mkdtemp(prefix="bigfleet-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True, args=ARGS)
        try:
            yield ctx
        finally:
            ctx.close()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet(browser: Any) -> Iterator[Fleet]:
    with running_fleet() as f:
        yield f


def open_page(browser: Any, url: str) -> tuple[Any, list[str]]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("requestfailed", lambda r: errors.append(f"requestfailed: {r.url}"))
    page.goto(url)
    page.wait_for_function("Number(document.body.dataset.loaded || 0) >= 1", timeout=30_000)
    return page, errors


def agree(check: Callable[[], tuple[Any, Any]], timeout: float = 45.0) -> None:
    """Page and API agree eventually (the page polls every 3 s; the fleet may still be moving)."""
    deadline = time.monotonic() + timeout
    while True:
        shown, want = check()
        if shown == want:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"page shows {shown!r}, API says {want!r}")
        time.sleep(0.5)


def table(page: Any, table_id: str) -> list[list[str]]:
    rows: list[list[str]] = page.eval_on_selector_all(
        f"#{table_id} tbody tr", "rows => rows.map(r => Array.from(r.cells).map(c => c.textContent))")
    return [r for r in rows if r != ["none"]]


def test_shard_dashboard_shows_what_the_api_says(browser: Any, fleet: Fleet) -> None:
    page, errors = open_page(browser, f"http://{fleet.shard_http}/")
    try:
        assert page.title() == "BigFleet dashboard"
        assert page.inner_text("#component") == "shard" and page.inner_text("#node-id") == "shard-a"

        def totals() -> tuple[Any, Any]:
            c = fleet.counts()
            shown = (page.inner_text("#tile-total"), page.inner_text("#tile-bound"),
                     sorted((r[0], r[1]) for r in table(page, "inventory-states")))
            want = (str(c.total), str(sum(c.bound_by_cluster.values())),
                    sorted((k.removeprefix("MACHINE_STATE_").lower(), str(v)) for k, v in c.by_state.items()))
            return shown, want
        agree(totals)

        def bound_per_cluster() -> tuple[Any, Any]:
            return ({r[0]: r[2] for r in table(page, "clusters")},
                    {cid: str(fleet.counts().bound_by_cluster.get(cid, 0)) for cid in ("c1", "c2")})
        agree(bound_per_cluster)

        def shortfalls() -> tuple[Any, Any]:
            return (sorted(r[1] for r in table(page, "shortfalls")),
                    sorted(str(s.priority) for s in fleet.shortfalls().shortfalls))
        agree(shortfalls)
        assert page.inner_text("#tile-shortfalls") == str(len(table(page, "shortfalls")))

        shards = table(page, "shards")
        assert [r[0] for r in shards] == ["shard-a"] and shards[0][1] == fleet.shard_addr and shards[0][2] == "up"
        needs = {r[0]: r[3] for r in table(page, "needs")}
        assert needs == {"c1": "yes", "c2": "no"}
        assert [r[0] for r in table(page, "capacity")] == ["c1", "c2"]
        assert table(page, "actions"), "the Configure/Create actions that bound c1 are listed"
        # The chart has drawn its series once there are points.
        page.wait_for_function("document.querySelectorAll('#chart-machines polyline').length === 3", timeout=30_000)
        assert page.is_hidden("#error")
        assert errors == []
    finally:
        page.close()


def test_coordinator_dashboard_shows_what_the_api_says(browser: Any, fleet: Fleet) -> None:
    from bigfleet.v1alpha1 import coordinator_pb2 as cpb

    assert fleet.coord is not None
    leader = fleet.coord.leader()
    page, errors = open_page(browser, f"http://{fleet.coord_http}/")
    try:
        assert page.inner_text("#component") == "coordinator"

        def shards() -> tuple[Any, Any]:
            listed = fleet.coord.call(leader, "ListShards", cpb.ListShardsRequest()).shards  # type: ignore[union-attr]
            return ([r[0] for r in table(page, "shards")], [s.shard_id for s in listed])
        agree(shards)

        def clusters() -> tuple[Any, Any]:
            bindings = fleet.coord.call(leader, "ListClusterBindings", cpb.ListClusterBindingsRequest()).bindings  # type: ignore[union-attr]
            return (sorted((r[0], r[1]) for r in table(page, "clusters")),
                    sorted((b.cluster_id, b.shard_id) for b in bindings))
        agree(clusters)

        def machines() -> tuple[Any, Any]:
            return page.inner_text("#tile-total"), str(fleet.counts().total)
        agree(machines)
        assert page.inner_text("#tile-clusters") == "2"
        # Per-need sections are the shard's; a coordinator shows instance types from shard reports.
        assert page.is_hidden("#needs") and page.is_hidden("#capacity")
        assert page.inner_text("#inventory-key") == "instance type"
        assert sum(int(r[1]) for r in table(page, "inventory-states")) == fleet.counts().total
        assert page.is_hidden("#error")
        assert errors == []
    finally:
        page.close()
