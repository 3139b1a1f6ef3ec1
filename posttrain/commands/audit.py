"""`posttrain audit --verifier NAME`: the exploit suite; non-zero exit if the verifier is fooled."""

from __future__ import annotations

from posttrain.errors import UserError


def register(subparsers) -> None:
    """Add the `audit` command."""
    parser = subparsers.add_parser(
        "audit", help="try to fool a verifier with known exploits (each must score 0) and honest "
                      "answers (each must score 1)")
    parser.add_argument("--verifier", required=True,
                        help="math, exact, numeric, format, rg, humaneval, io or stdio")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="per-sample budget of code verifiers in seconds (default 3)")
    parser.add_argument("--unsafe-no-sandbox", action="store_true",
                        help="audit code verifiers without bubblewrap (not isolated!)")
    parser.set_defaults(func=handle)


def handle(args) -> int:
    """Run the suite, print the table, return 1 if any case failed."""
    from posttrain.rewards.audit import AUDIT_TIMEOUT_S, SUITES, format_table, run_audit
    from posttrain.rewards.sandbox import SandboxUnavailable

    if args.verifier not in SUITES:
        raise UserError(f"--verifier: no built-in audit suite for {args.verifier!r} "
                        f"(suites: {', '.join(SUITES)})")
    if args.workers is not None and args.workers < 1:
        raise UserError("--workers must be at least 1")
    try:
        outcomes, seconds = run_audit(args.verifier, workers=args.workers,
                                      timeout_s=args.timeout or AUDIT_TIMEOUT_S,
                                      unsafe_no_sandbox=args.unsafe_no_sandbox)
    except SandboxUnavailable as error:
        raise UserError(str(error), exit_code=3) from None
    print(format_table(outcomes))
    failed = [o for o in outcomes if not o.passed]
    counts = {kind: sum(o.case.kind == kind for o in outcomes) for kind in ("exploit", "honest", "malformed")}
    print(f"\naudit {args.verifier}: {len(outcomes) - len(failed)}/{len(outcomes)} passed "
          f"({counts['exploit']} exploits, {counts['honest']} honest, {counts['malformed']} malformed) "
          f"in {seconds:.1f} s" + (" [UNSAFE: no sandbox]" if args.unsafe_no_sandbox else ""))
    for outcome in failed:
        print(f"FAILED: {outcome.case.kind} {outcome.case.name!r} -> {outcome.verdict.status} "
              f"{outcome.verdict.reward} ({outcome.verdict.reason})")
    return 1 if failed else 0
