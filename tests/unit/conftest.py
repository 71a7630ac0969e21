"""The quick part (README: `python -m pytest -q tests/unit`, about a minute on 2 cores).

Its tests run tiny models, whose ops are too small to gain from being split across cores; split,
each op's threads wait for each other, and on a busy machine they wait for the scheduler too. One
intra-op thread in this process: on a 2-core machine at a load of about 3 the quick part took 30 s
(30 s of CPU) with it and 82 s (78 s of CPU) with torch's default of 2 threads. Every comparison in
these tests runs both of its sides in this process, under the same setting; tests/integration keeps
torch's default.
"""

import torch

torch.set_num_threads(1)
