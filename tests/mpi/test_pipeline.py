"""Pipeline runtime under MPI (tests/mpi/ranks/pp_equivalence.py on 4 ranks): for p = 1, 2, 4
pipeline ranks, every schedule and m in {1, p, 2p+1} micro-batches, the loss and every
rank's gradients equal the unpartitioned model's (fp32, rtol 1e-5 / atol 4e-5); activation
shapes vary between stages and micro-batches; a missing peer is an error, not a hang.  The
same with payloads staged through host slots as CUDA ones are (copies run late on the CPU),
every slot back in the pool after the step."""
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]


def test_every_schedule_matches_the_whole_model(run_ranks):
    recs = run_ranks(4, "pp_equivalence.py", timeout=300).check().records()
    cases = [r for r in recs if "schedule" in r and not r["staged"]]
    staged = [r for r in recs if r.get("staged")]
    # staged payloads: 1F1B and interleaved at p = 2 and 4, 2p + 1 micro-batches, every rank
    assert len(staged) == 2 * 2 * 4 and not [r for r in staged if r["errors"]], staged[:3]
    assert all(r["checked"] > 0 for r in staged)
    # slots were made (64-byte ones: several per activation) and reused: a few for the step,
    # where the payloads sent alone fill more than twice as many
    assert all(0 < r["slots"] and r["slots"] * 64 < r["sent"] / 2 for r in staged), staged
    want = {(name, p, m, v, rank) for name, v in SCHEDULES for p in (1, 2, 4)
            for m in {1, p, 2 * p + 1} for rank in range(4)}
    got = {(r["schedule"], r["p"], r["m"], r["v"], r["rank"]) for r in cases}
    assert got == want
    failures = [r for r in cases if r["errors"]]
    assert not failures, failures[:3]
    assert all(r["checked"] > 0 for r in cases)
    for r in cases:
        stage0 = r["rank"] % r["p"] == 0
        if r["schedule"] == "gpipe" and stage0:
            assert r["peak_live"] == r["m"]          # GPipe keeps every micro-batch alive
        if r["schedule"] == "1f1b":
            assert r["peak_live"] == min(r["p"] - r["rank"] % r["p"], r["m"])
    hangs = {r["rank"]: r["hang"] for r in recs if "hang" in r}
    for rank in (0, 2):
        assert hangs[rank] == ("pipeline rank 0: no gradient of micro-batch 0 for stage 0 from "
                               "pipeline rank 1 after 1.5 s (did it fail or run a different schedule?)")
