"""``python -m bigfleet.k8stest --kubeconfig PATH``: run the test API server until interrupted."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal

from bigfleet.k8stest.server import KubeTestServer


async def _run(port: int, kubeconfig: str | None, bookmark_interval: float) -> None:
    srv = await KubeTestServer(bookmark_interval=bookmark_interval).start(port)
    if kubeconfig:
        srv.kubeconfig(kubeconfig)
    print(f"k8stest API server listening on {srv.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await srv.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bigfleet.k8stest", description=__doc__)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--kubeconfig", help="write a kubeconfig pointing at the server here")
    ap.add_argument("--bookmark-interval", type=float, default=5.0)
    args = ap.parse_args(argv)
    asyncio.run(_run(args.port, args.kubeconfig, args.bookmark_interval))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
