"""Browser tests share the integration cluster fixtures."""
from tests.integration.conftest import make_cluster  # noqa: F401
