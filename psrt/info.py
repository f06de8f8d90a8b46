"""`python -m psrt.info`: where did my ranks land? (psrt/launch/info.py), and with --predict
what psrt's step model expects of each strategy on this job's placement (psrt.bench)."""
import sys

from psrt.errors import cli_main
from psrt.launch import info


def build_parser():
    p = info.build_parser()
    p.add_argument("--predict", metavar="PRESET",
                   help="rank 0 prints each strategy's predicted step on this job's placement (its hosts "
                        "and ranks per host) with the links of a cluster preset (dgx-a100, pcie-25g, emulated, "
                        "or a JSON/TOML file: psrt/bench/presets.py)")
    p.add_argument("--profile", default="resnet50",
                   help="with --predict: the model profile (vgg16, resnet50, gpt2-small, bert-base, or a "
                        "profile JSON file; default resnet50)")
    return p


def predicted(records: list[dict], preset_name: str, profile_name: str) -> list[str]:
    """Rank 0's lines for --predict: the preset, the profile and the table of
    psrt.bench.scaling_prediction for this job's placement (hosts in order of first rank)."""
    from psrt.bench import presets, scaling_prediction
    from psrt.train.profile import load
    from psrt.train.report import format_table
    preset, profile = presets.load(preset_name), load(profile_name)
    ranks = sorted(records, key=lambda r: r["rank"])
    hosts = list(dict.fromkeys(r["hostname"] for r in ranks))
    rows = scaling_prediction.placement_rows(profile, preset, [hosts.index(r["hostname"]) for r in ranks])
    return ([f"predicted on {preset['name']}'s links ({preset['source']}) for this placement: {profile.describe()}"]
            + format_table(rows, scaling_prediction.COLUMNS).splitlines())


@cli_main("psrt.info")
def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.predict:     # a bad preset or profile: one line, before MPI starts
        from psrt.bench import presets
        from psrt.train.profile import load
        presets.load(args.predict)
        load(args.profile)
    return info.main(argv, parser=parser, more=more)


def more(records: list[dict], args) -> list[str]:
    """What psrt.info adds after psrt.launch.info's summary."""
    return predicted(records, args.predict, args.profile) if args.predict else []


if __name__ == "__main__":
    sys.exit(main())
