"""`python -m rmsft_operator` / `rmsft operator`: run the kopf operator in this process."""

from __future__ import annotations

import argparse

from rmsft.logs import LogLevelError, configure_logging


def run(namespaces: list[str], all_namespaces: bool, liveness: str | None, verbose: bool = False) -> None:
    import kopf

    import rmsft_operator.handlers  # noqa: F401  (registers the handlers)

    if not namespaces and not all_namespaces:
        raise SystemExit("rmsft operator: give --namespace NS (repeatable) or --all-namespaces")
    try:  # --verbose (the chart's logLevel: debug) wins; otherwise RMSFT_LOG_LEVEL, else info
        configure_logging("info", override="debug" if verbose else None)
    except LogLevelError as e:
        raise SystemExit(f"rmsft operator: {e}") from None
    # One operator replica owns all jobs (no kopf peering objects to create or RBAC for).
    kopf.run(standalone=True, clusterwide=all_namespaces, namespaces=namespaces, liveness_endpoint=liveness)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="rmsft operator", description=__doc__)
    p.add_argument("--namespace", "-n", action="append", default=[], help="namespace to watch (repeatable)")
    p.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    p.add_argument("--liveness", default=None, help="liveness endpoint, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("--verbose", action="store_true")
    a = p.parse_args(argv)
    run(a.namespace, a.all_namespaces, a.liveness, a.verbose)


if __name__ == "__main__":
    main()
