"""Cost of one model call over n new tokens (SmolLM2-135M fp32, 1 thread, 300-token cache, best of 5):
what a tree of n candidates costs to verify on this machine (docs/HIDDEN_TRANSFER.md)."""

import time
import torch
import layerleap

torch.set_num_threads(1)
m = layerleap.load("smollm2-135m")
ids = torch.randint(0, 1000, (1, 300))
with torch.inference_mode():
    for n in [1, 2, 4, 8, 12, 16, 24, 32]:
        best = 1e9
        for _rep in range(5):
            c = m.new_cache(1, 400)
            m.run_layers(m.embed(ids), 0, 30, torch.arange(300).unsqueeze(0), c)
            x = torch.randint(0, 1000, (1, n))
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
            t = time.perf_counter()
            h = m.run_layers(m.embed(x), 0, 30, (300 + torch.arange(n)).unsqueeze(0), c, mask if n > 1 else None)
            lg = m.logits(h[:, :1])
            best = min(best, time.perf_counter() - t)
        print(n, f"{best * 1000:.1f} ms")
