"""What constrains the worker's options, below ``engine_worker.settings``: the
settings import these checks, and they import nothing of the worker.

| module | what |
|---|---|
| ``exllamav3`` | ExLlamaV3's limits on its options (``validate``), its defaults, two parsers |
| ``paths`` | the checks that read the disk (model folders, the embedded model) and ``--n-gpu-layers`` |
"""
