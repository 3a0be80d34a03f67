"""``pykeops.config``'s flags that user code reads (there is no KeOps build to configure)."""
import importlib.util

import torch

gpu_available = torch.cuda.is_available()
torch_found = True
numpy_found = importlib.util.find_spec("numpy") is not None
