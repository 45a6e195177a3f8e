# Type stub of the compiled module pagedkv/_prefix_chains.pyx.
from typing import Dict, Sequence, final

import numpy as np
import numpy.typing as npt

from pagedkv._page_table import PageTables

@final
class PrefixChains:
    def __init__(self, tables: PageTables) -> None: ...
    # keys: "pages" [P, N] int32, "parents" [N] int64, "tokens" [N, page_size] int32
    def export(self) -> Dict[str, np.ndarray]: ...
    def reserve(self, token_ids: npt.NDArray[np.int32], parents: npt.NDArray[np.int64],
                held: npt.NDArray[np.bool_], reserves: Sequence[int]) -> npt.NDArray[np.int32]: ...
    def commit(self) -> int: ...
    def undo(self) -> None: ...
