"""LoRA adapters served beside one base model: PEFT directories read into a host-side store
(adapter.py), the low-rank products that run beside each linear's base matmul for the rows of each
adapter in a batch (layers.py), and which adapters are resident in the batch's slots (manager.py)."""
