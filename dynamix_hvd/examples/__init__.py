"""Example training scripts: plain Horovod + PyTorch jobs whose dynamix_hvd lines are marked ``# dx``.

`mlp` (generated data, no download) is what ``dynamix-hvd run`` launches. Horovod's own examples with
the same change are in the source tree's docs/integration/.
"""
