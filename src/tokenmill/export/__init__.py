"""Exports of trained checkpoints to other ecosystems, and imports back (docs/export.md).

`run.py` reads a run's checkpoint (local or gs://) into plain NumPy arrays with the run's identity;
`tensors.py` writes and reads safetensors files, sharded and one shard at a time; `hf.py` maps the model onto
a Hugging Face model folder (the DeepSeek-style family onto transformers' stock Dots1ForCausalLM) and back;
`reference.py` is tokenmill's own greedy decode, the reference an export's generate() is checked against;
`commands.py` is `tokenmill export hf` and `tokenmill import hf`.

Above the trainer: it reads checkpoints through the trainer's own code and nothing of the trainer imports it.
"""
