"""On-policy distillation of the tiny model from a stronger teacher (issue 44 item 3): held-out
greedy accuracy of the student before -> after N distillation steps, the teacher's own, and the
same student trained by plain GRPO for the same steps (the control).

The teacher (``--teacher``): ``grpo`` (the default) is the default warm-started tiny model (the
project's warm start, ``tiny_warmup.py``) trained further by the default GRPO run for
``--teacher-steps`` steps; ``warmstart`` is a tiny model of ``--teacher-hidden``/``-layers``/
``-heads`` warm-started by the same code to ``--teacher-target`` training accuracy (a larger one
takes hours on a shared 2-core machine: 0.6 supervised steps/s there). Either shares the
student's character tokenizer. The student is the default warm-started tiny model (or one
warm-started to ``--student-target``). Every run is the plain loop (``verl_core.train.train``) on
the defaults but the keys printed, so the held-out set is the default 500 synthetic prompts of the
seed; SE is the standard error of a gain as in ``tests/verl_core/test_train_loop.py`` (unpaired,
conservative).

    python bench/distill.py                      # alone, mixed and the GRPO control, 60 steps
    python bench/distill.py --modes alone --steps 30
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

MODES = {
    "alone": {"algorithm.distill_use_task_rewards": False},  # the signal is the advantage
    "mixed": {"algorithm.distill_use_task_rewards": True},   # GRPO's advantage + coef x signal
    "grpo": None,                                            # the control: no teacher
}


def _se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--modes", default="alone,mixed,grpo")
    ap.add_argument("--coef", type=float, default=1.0, help="algorithm.distill_coef (mixed)")
    ap.add_argument("--teacher", choices=("grpo", "warmstart"), default="grpo",
                    help="grpo: the default model trained further by GRPO; warmstart: a tiny "
                         "model (--teacher-hidden/-layers/-heads) warm-started to --teacher-target")
    ap.add_argument("--teacher-hidden", type=int, default=64)
    ap.add_argument("--teacher-layers", type=int, default=2)
    ap.add_argument("--teacher-heads", type=int, default=2)
    ap.add_argument("--teacher-steps", type=int, default=120,
                    help="GRPO steps (--teacher grpo) or at most so many supervised steps")
    ap.add_argument("--teacher-target", type=float, default=0.7)
    ap.add_argument("--student-target", type=float, default=None,
                    help="the student's model.warmup_target_accuracy (default: the default's)")
    ap.add_argument("--threads", type=int, default=1,
                    help="num_threads (1: the least contention on a shared 2-core machine)")
    ap.add_argument("--workdir", default="")
    a = ap.parse_args(argv)

    from verl_core.assets import prepare_assets
    from verl_core.config import preset
    from verl_core.train import train
    from verl_core.trainer import RLTrainer
    from verl_core.types import STORES

    work = a.workdir or tempfile.mkdtemp(prefix="bench-distill-")
    quiet = lambda *_: None  # noqa: E731
    say = lambda *x: print(*x, flush=True)  # noqa: E731 - the warm start's progress lines
    print(f"command: python bench/distill.py {' '.join(argv or sys.argv[1:])}".rstrip())

    n = preset("grpo").data.synthetic_val_size
    t0 = time.perf_counter()
    if a.teacher == "grpo":
        # the teacher: the default warm-started model trained further by the default GRPO run
        # (README command 1's plain loop) for --teacher-steps steps; its held-out accuracy is
        # that run's end accuracy
        teacher_keys = {"seed": a.seed, "num_threads": a.threads, "total_steps": a.teacher_steps}
        t = train(preset("grpo", **teacher_keys), os.path.join(work, "teacher"), log=quiet)
        teacher_path, teacher_acc = t["final_model"], t["end_accuracy"]
        how = (f"GRPO {teacher_keys}: held-out accuracy {t['start_accuracy']:.3f} -> "
               f"{teacher_acc:.3f}")
    else:
        # the teacher: a tiny model of --teacher-hidden/-layers/-heads warm-started by the same
        # code as the student, to a higher training accuracy
        teacher_keys = {"seed": a.seed, "num_threads": a.threads,
                        "model.tiny_hidden_size": a.teacher_hidden,
                        "model.tiny_layers": a.teacher_layers, "model.tiny_heads": a.teacher_heads,
                        "model.warmup_sft_steps": a.teacher_steps,
                        "model.warmup_target_accuracy": a.teacher_target}
        t_cfg = preset("grpo", **teacher_keys)
        # in a run store of its own: the same --workdir again resumes or reuses it
        t_assets = prepare_assets(t_cfg, os.path.join(work, "teacher"), log=say,
                                  store=STORES.open(os.path.join(work, "teacher-store")))
        trainer = RLTrainer(t_cfg, t_assets)
        teacher_path, teacher_acc = t_assets.model_path, trainer.evaluate()["val/accuracy"]
        trainer.close()
        how = f"warm start {teacher_keys}: held-out accuracy {teacher_acc:.3f}"
    print(f"teacher ({time.perf_counter() - t0:.0f} s): {how} (n={n})", flush=True)

    for mode in a.modes.split(","):
        keys = {"seed": a.seed, "num_threads": a.threads, "total_steps": a.steps}
        if a.student_target is not None:
            keys["model.warmup_target_accuracy"] = a.student_target
        if MODES[mode] is not None:
            keys.update({"algorithm.distill_teacher_path": teacher_path, **MODES[mode]})
            if mode == "mixed":
                keys["algorithm.distill_coef"] = a.coef
        t0 = time.perf_counter()
        s = train(preset("grpo", **keys), os.path.join(work, f"student-{mode}"), log=quiet)
        wall = time.perf_counter() - t0
        p0, p1 = s["start_accuracy"], s["end_accuracy"]
        se = math.sqrt(_se(p0, n) ** 2 + _se(p1, n) ** 2)
        rollout_s = sorted(h.get("timing/rollout_s", 0.0) for h in s["history"])
        kl = [h.get("distillation/loss") for h in s["history"]]
        kl_line = f", reverse KL (k1) {kl[0]:.3f} -> {kl[-1]:.3f}" if kl[0] is not None else ""
        shown = {k: v for k, v in keys.items() if k != "algorithm.distill_teacher_path"}
        print(f"{mode}: {shown}: held-out accuracy {p0:.3f} -> {p1:.3f} "
              f"({p1 - p0:+.3f}, {(p1 - p0) / se:.1f} SE, SE {se:.3f}); reward "
              f"{s['first_reward']:.3f} -> {s['last_reward']:.3f}{kl_line}; "
              f"{wall:.0f} s ({wall / a.steps:.2f} s/step, the rollout phase's median "
              f"{rollout_s[len(rollout_s) // 2]:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
