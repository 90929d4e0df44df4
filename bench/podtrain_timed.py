"""``podtrain train`` at whatever config it is given, timed by the baselines' own clock.

    torchrun ... bench/podtrain_timed.py --warmup 10 --steps 30 --tokens-per-step 8192 CONFIG [k=v ...]

The run is podtrain's CLI, unchanged; the only addition is ``bare_ddp.RankTimer`` around its
optimizer steps (a wrapper of ``Stepper.step`` that calls the real one): the barrier and clock
start at the end of step ``--warmup`` and stop at the end of step ``--steps``, so podtrain's window
holds the same steps as the bare loop's, with everything podtrain does between them (its loader,
logging, monitors, garbage collection) inside. Each rank prints one JSON line.
"""

import argparse
import sys

from bare_ddp import RankTimer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--tokens-per-step", type=int, required=True)
    args, train_args = p.parse_known_args()
    from podtrain.cli import main as podtrain_main
    from podtrain.train import step as step_module

    timer = RankTimer("podtrain", args.tokens_per_step)
    real_step = step_module.Stepper.step
    done = 0

    def step(self, micro_batches):
        nonlocal done
        out = real_step(self, micro_batches)
        done += 1
        if done == args.warmup:
            timer.start()
        elif done == args.steps:
            timer.stop(args.steps - args.warmup)
        return out

    step_module.Stepper.step = step
    sys.exit(podtrain_main(["train", *train_args]))


if __name__ == "__main__":
    main()
