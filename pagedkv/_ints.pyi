# Type stub of the compiled module pagedkv/_ints.pyx.
from typing import List, Optional

import numpy as np

def int64_from_list(values: List[object]) -> Optional[np.ndarray]: ...
