"""The HF Trainer baseline: transformers' ``Trainer`` on the same model, data, batch and schedule.

The tiny preset, packed windows of the same shard (``bare_ddp.Windows``) under the Trainer's own
distributed sampler, micro-batch 8 with gradient accumulation up to the global batch, AdamW
(fused) with warmup + cosine, gradient clipping at 1.0, fp32, no evaluation, no saving, no
logging. Run under torchrun; each rank prints one JSON line (``bare_ddp.RankTimer``: after
``--warmup`` optimizer steps, the wall time between barriers to the last step's end, and its CPU time).
"""

import os

import torch
import torch.distributed as dist

from bare_ddp import RankTimer, Windows, tiny_model, workload_parser


def main():
    p = workload_parser()
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-lr-steps", type=int, default=20)
    args = p.parse_args()
    from transformers import Trainer, TrainerCallback, TrainingArguments

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = tiny_model()
    ds = Windows(os.path.join(args.data, "train_00000.bin"), args.seq_len)

    def collate(rows):
        batch = torch.stack(rows)
        return {"input_ids": batch[:, :-1], "labels": batch[:, :-1].clone()}

    timer = RankTimer("hf_trainer", args.global_batch * args.seq_len)

    class Timer(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            if state.global_step == args.warmup:
                timer.start()
            if state.global_step == args.steps:
                timer.stop(args.steps - args.warmup)

    with_tmp = os.environ.get("TMPDIR", "/tmp")
    targs = TrainingArguments(
        output_dir=os.path.join(with_tmp, f"hf_baseline_{os.getpid()}"), max_steps=args.steps,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.global_batch // (args.micro * world),
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=args.warmup_lr_steps,
        weight_decay=0.1, max_grad_norm=1.0, optim="adamw_torch_fused", report_to=[],
        save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, dataloader_drop_last=True, use_cpu=True, seed=0,
        ddp_find_unused_parameters=False,  # its default (True) would slow it: the strong baseline
        ddp_backend="gloo" if world > 1 else None, remove_unused_columns=False)
    trainer = Trainer(model=model, args=targs, train_dataset=ds, data_collator=collate,
                      callbacks=[Timer()])
    trainer.train()
    # The DDP reducer must go before the process group: left to interpreter exit, gloo's can
    # abort ("terminate called without an active exception"; see MACHINE-NOTES).
    del trainer, model
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
