"""`posttrain pairs --model M --data.task T --group-size G --out pairs.jsonl`: preference pairs from
verified samples (see posttrain/recipes/pairs.py); `--unpaired` KTO rows, `--sft` a teacher's SFT rows. Every field of `PairSettings` is a flag
(`--key value`, dotted for the sampling section: `--sampling.temperature 0.8`), or a key of
`--config FILE`."""

from __future__ import annotations

import shlex

from posttrain.commands._recipe import config_command
from posttrain.errors import UserError

SAMPLING_FLAGS = {"--temperature": "--sampling.temperature", "--top-p": "--sampling.top_p", "--top-k": "--sampling.top_k",
                  "--max-new-tokens": "--sampling.max_new_tokens"}
"""The sampling flags of before the sampling section, still accepted (each names one field)."""


def register(subparsers) -> None:
    """Add the `pairs` command."""
    parser = config_command(
        subparsers, "pairs", "posttrain.recipes.pairs",
        "sample G answers per prompt, score them with a verifier, write (correct, incorrect) pairs (or --sft rows)", config="PairSettings",
        description="Sample G answers per training prompt, score them with the task's verifier, and write "
                    "(correct, incorrect) preference pairs plus a .meta.json provenance sidecar; --unpaired: KTO rows; "
                    "--sft: SFT rows of the model's (a teacher's) samples for posttrain sft. "
                    "--temperature, --top-p, --top-k and --max-new-tokens are short for --sampling.<key>.",
    )
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="stop string (repeatable; the same as --sampling.stop_strings [TEXT, ...])")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file and its sidecar (refused without it, before any work)")
    parser.add_argument("--unpaired", action="store_true",
                        help="write KTO's unpaired rows (prompt, completion, label) from every scored answer instead of pairs")
    parser.add_argument("--sft", action="store_true",
                        help="write SFT rows (prompt, completion) of --model's samples (a teacher) for posttrain sft; "
                             "--keep all|correct, --distinct, --max-rows N, --max-tokens N")
    parser.add_argument("--distinct", action="store_true",
                        help="with --sft: one row per distinct completion of a prompt (repeats dropped, counted)")
    parser.set_defaults(func=handle)


def settings_overrides(arguments: list[str], stops: list[str]) -> dict:
    """The `--key value` overrides, with the old sampling flags read as their sampling keys."""
    from posttrain.config import parse_overrides  # here: posttrain.config imports torch (hardware)

    renamed = []
    for argument in arguments:
        flag, separator, value = argument.partition("=")
        renamed.append(SAMPLING_FLAGS.get(flag, flag) + separator + value)
    overrides = parse_overrides(renamed, once=True)
    if stops:
        overrides.setdefault("sampling", {})["stop_strings"] = list(stops)
    options = overrides.get("data", {}).get("task_options") if isinstance(overrides.get("data"), dict) else None
    if options is not None and not isinstance(options, dict):  # read as YAML, so JSON works too
        raise UserError(f"--data.task_options: must be a JSON object (a mapping), got {options!r}")
    return overrides


def handle(args) -> int:
    from posttrain.config import build_config
    from posttrain.data.provenance import provenance_path
    from posttrain.recipes.pairs import PairSettings, build_pairs

    overrides = settings_overrides(list(args.overrides or []), args.stop)
    for flag in ("overwrite", "unpaired", "sft", "distinct"):
        if getattr(args, flag):
            overrides[flag] = True
    settings = build_config(PairSettings, args.config, overrides)
    result = build_pairs(settings)
    print("\n".join(summary_lines(result)))
    print(f"wrote {settings.out} and {provenance_path(settings.out)}")
    if result.get("sft"):
        system = f" --data.system_prompt {shlex.quote(settings.data.system_prompt)}" if settings.data.system_prompt else ""
        print(f"next: posttrain sft --data.task {shlex.quote(str(settings.out))}{system} --model STUDENT --output-dir DIR")
    return 0


def summary_lines(result: dict) -> list[str]:
    """What `posttrain pairs` prints of `build_pairs`' provenance record: what was written and what
    was skipped (with a judge: ties, below --preference-margin, apart from the judge's failures),
    then who labelled."""
    if result.get("sft"):
        dropped = result["dropped"]
        return [f"{result['rows']} SFT rows, {result['completion_tokens']} completion tokens, from {result['prompts_with_rows']} of "
                f"{result['prompts']} prompts (--keep {result['keep']}: {result['keep_means']}; of {result['samples']} samples dropped: "
                f"{dropped['rejected']} rejected, {dropped['unscored']} unscored, {dropped['empty']} empty, {dropped['duplicates']} repeats "
                f"({result['duplicates']} seen), {dropped['over_budget']} over budget{'; budget reached' if result['budget_reached'] else ''}; "
                f"{result['rows_truncated']} rows cut at max_new_tokens; verdict errors: {result['verdict_errors']})",
                f"teacher: model {result['model']} (G={result['group_size']}, seed {result['seed']}); verifier {result['verifier']} "
                f"accepted {result['samples_correct']} of {result['samples']} samples"]
    if result.get("unpaired"):
        what = (f"{result['rows']} unpaired rows ({result['desirable']} desirable, {result['undesirable']} undesirable) from "
                f"{result['prompts'] - result['prompts_unscored']} of {result['prompts']} prompts (rows from groups with both kinds: "
                f"{result['rows_from_mixed_groups']}, all correct: {result['rows_from_all_correct_groups']}, all incorrect: "
                f"{result['rows_from_all_incorrect_groups']}; {result['duplicates_dropped']} repeated answers dropped; "
                f"verdict errors: {result['verdict_errors']})")
    elif result.get("labeller"):
        what = (f"{result['pairs']} pairs from {result['prompts_paired']} of {result['prompts']} prompts, labelled by {result['verifier']} "
                f"(skipped: {result['prompts_skipped_tied']} prompts whose pairs were ties, {result['prompts_skipped_judge_failed']} "
                f"the judge could not compare, {result['prompts_skipped_one_answer']} with one distinct answer)")
    else:
        what = (f"{result['pairs']} pairs from {result['prompts_paired']} of {result['prompts']} prompts "
                f"(skipped: {result['prompts_skipped_all_correct']} all correct, {result['prompts_skipped_all_incorrect']} all incorrect, "
                f"{result['prompts_skipped_unscored']} unscored; verdict errors: {result['verdict_errors']})")
    if not result.get("labeller"):
        return [what, f"labels: verifier {result['verifier']} on samples of model {result['model']} (G={result['group_size']}, seed {result['seed']})"]
    bias = result["position_bias_mean"]
    failures = ", ".join(f"{reason} ({count})" for reason, count in result["judge_failure_reasons"].items())
    return [what, f"labels: {result['labeller']}: {result['verifier']} on samples of model {result['model']} (G={result['group_size']}, "
                  f"seed {result['seed']}); of {result['pairs_compared']} pairs compared, {result['pairs_tied']} ties (no clear preference: "
                  f"|P - 1/2| < --preference-margin {result['preference_margin']:g}), {result['pairs_judge_failed']} the judge could not compare"
                  f"{': ' + failures if failures else ''}; mean position bias {'n/a' if bias is None else format(bias, '+.3f')}"]
