"""The device names a worker takes (``COSERVE_DEVICE``, ``--device``): what the README and `coserve worker --help`
document. No imports: the settings read it without loading the engine."""

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"
DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
