"""Multi-LoRA serving inside the scheduler (S-LoRA / Punica style).

- `adapter.py`: one PEFT adapter read from disk (`adapter_config.json` + `adapter_model.safetensors`),
  checked and mapped onto the model's fused projections, held in host memory.
- `layers.py`: `LoraProjection`, a forward hook on a target linear (qkv_proj, o_proj, gate_up_proj, down_proj)
  that adds each row's low-rank update, segmented by adapter; `LoraBatch`, the per-forward plan.
- `manager.py`: the loaded adapters by name, the slot pool the forward reads (`--max-loras-per-batch`
  slots of rank `--max-lora-rank`, reserved at startup), and the plan for each ForwardBatch.

The model files are not touched: the hooks are attached to the targets by module name at load time.
"""
