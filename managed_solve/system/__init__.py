"""Systems and their properties: LinearSystem, input validation, the auto policy, the cost model."""

from .inputs import as_operator as as_operator
from .inputs import as_vector as as_vector
from .inputs import check_dtype as check_dtype
from .inputs import result_dtype as result_dtype
from .linear_system import LinearSystem as LinearSystem
from .method import FALLBACK as FALLBACK
from .method import METHODS as METHODS
from .method import PRECONDITIONERS as PRECONDITIONERS
from .method import check_preconditioner as check_preconditioner
from .method import choose_method as choose_method
from .method import krylov_method as krylov_method
from .method import prefers_cg as prefers_cg
from .properties import cg_iteration_bound as cg_iteration_bound
from .properties import is_symmetric as is_symmetric
from .properties import positive_diagonal as positive_diagonal
