"""CPU port: the causal LM loaded on the CPU (device_map={"": "cpu"}), greedy generation. The model is a tiny
random Llama saved to a temporary folder first."""
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=32)
torch.manual_seed(0)
with tempfile.TemporaryDirectory() as folder:
    LlamaForCausalLM(config).save_pretrained(folder)
    models = {name: LlamaForCausalLM.from_pretrained(folder, device_map={"": "cpu"}, dtype=torch.float32)
              for name in ("auto", "balanced")}
    models["index 0"] = LlamaForCausalLM.from_pretrained(folder, device_map={"": "cpu"}, dtype=torch.float32)
    for name, model in models.items():
        ids = torch.tensor([[1, 5, 9, 3]]).to(model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        print(name, out.tolist(), "one device:", len({p.device for p in model.parameters()}) == 1)
