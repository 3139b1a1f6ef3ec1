"""`posttrain compare`: every online and offline method from one SFT start, the same budget each,
scored on the same held-out problems (posttrain/recipes/compare.py; docs/algorithms.md §3e).

    posttrain compare                                   # the whole table, runs/compare
    posttrain compare --rows grpo,rloo,dpo --steps 4 --start runs/compare-old/sft
    posttrain compare --rows grpo,distill,sft_teacher --teacher runs/tiny-grpo-teacher --start runs/compare-old/sft
"""

from __future__ import annotations

import argparse


def _rows_epilog(parser: argparse.ArgumentParser) -> None:
    from posttrain.recipes.compare import (  # here: the recipe imports torch
        ROWS,
        links_changed,
    )

    width = max(len(row.name) for row in ROWS)
    parser.epilog = "rows (--rows NAME,NAME,...; default: all, those needing --teacher only with one):\n" + "\n".join(
        f"  {row.name:<{width}}  {row.label}: {links_changed(row)}" for row in ROWS)


def register(subparsers) -> None:
    """Add the `compare` command."""
    parser = subparsers.add_parser(
        "compare", help="one SFT start, every GRPO-family, PPO and DPO-family method, one table with paired held-out gains",
        description="From one SFT start on the tiny arithmetic task, train each row with the same budget (each in its own "
                    "process), score every result on the same held-out problems with the independent checker, and write "
                    "comparison.md, comparison.json and comparison.png in the output directory.",
        formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False, deferred=_rows_epilog)
    parser.add_argument("--rows", help="comma-separated row names (default: every row)")
    parser.add_argument("--steps", type=int, default=12, help="training steps of every row (default 12)")
    parser.add_argument("--sft-steps", type=int, default=600, help="the most SFT steps of the start (default 600; it stops at partial competence)")
    parser.add_argument("--eval-size", type=int, default=500, help="held-out problems per set (default 500)")
    parser.add_argument("--seed", type=int, default=0, help="one seed for the start, the pairs and every row (default 0)")
    parser.add_argument("--output-dir", default="runs/compare", help="where it all goes (default runs/compare; an earlier comparison there is replaced)")
    parser.add_argument("--start", metavar="DIR", help="reuse this SFT checkpoint (a model directory or an SFT run directory) instead of training one")
    parser.add_argument("--pairs", metavar="FILE", help="reuse this pairs file instead of sampling one from the start (the offline rows' same inputs again)")
    parser.add_argument("--teacher", metavar="DIR", help="the teacher of the distill and sft_teacher rows: a model directory, or a run "
                                                         "directory (its final/, else its newest checkpoint); without it those rows are left out")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process (default 1)")
    parser.set_defaults(func=handle)


def handle(args: argparse.Namespace) -> int:
    from posttrain.evaluation.comparison_report import closing_lines
    from posttrain.recipes import compare

    rows = None if args.rows is None else tuple(name.strip() for name in args.rows.split(",") if name.strip())
    config = compare.Config(output_dir=args.output_dir, rows=rows, steps=args.steps, sft_steps=args.sft_steps,
                            eval_size=args.eval_size, seed=args.seed, start=args.start, pairs=args.pairs, threads=args.threads,
                            teacher=args.teacher)
    config.validate()  # a bad row name is one line before any work
    out = compare.run(config)
    print("\n".join(closing_lines(out)))
    return 0
