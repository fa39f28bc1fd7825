"""Where a decode step's time goes: `cProfile` of one run, the hf_kvgov functions and torch's heaviest calls.

Two paths on SmolLM2: ``--path paged`` runs `model.generate` with `PagedCache` (batch 4 x 1,024 random prompt
tokens, 48 new), ``--path engine`` the `ServingEngine` (batch 8 x 256, 64 new, no prefix sharing). A warm-up run
comes first; the profiled run's wall time is printed. To compare two commits, run the script from this tree with
``PYTHONPATH`` set to each commit's worktree (the script imports only public names):

    OMP_NUM_THREADS=2 PYTHONPATH=WORKTREE python eval/profile_decode.py --path paged
    OMP_NUM_THREADS=1 PYTHONPATH=WORKTREE python eval/profile_decode.py --path engine
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from hf_kvgov import PagedCache, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=("paged", "engine"), required=True)
    parser.add_argument("--top", type=int, default=12, help="rows of each listing")
    args = parser.parse_args()
    model, _ = load_model("smollm2")
    generator = torch.Generator().manual_seed(0)
    if args.path == "paged":
        ids = torch.randint(100, 10000, (4, 1024), generator=generator)

        def run() -> None:
            options = {"max_new_tokens": 48, "min_new_tokens": 48, "do_sample": False, "pad_token_id": 0}
            model.generate(ids, cache=PagedCache(model), **options)

    else:
        from hf_kvgov.serving import SamplingParams, ServingEngine  # not in commits before the engine

        prompts = [torch.randint(100, 10000, (256,), generator=generator).tolist() for _ in range(8)]

        def run() -> None:
            with ServingEngine(model, prefix_sharing=False) as engine:
                engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))

    run()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    run()
    profile.disable()
    print(f"{args.path}: wall {time.perf_counter() - start:.2f} s")
    stats = pstats.Stats(profile).sort_stats("tottime")
    stats.print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("hf_kvgov", args.top)


if __name__ == "__main__":
    main()
