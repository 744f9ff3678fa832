"""coserve's co-serving engine.

Importable without FastAPI, Celery, Redis or SQLAlchemy: the same Engine, scheduler and
speculation policies drive a real model (``executor.torch``) or the simulator
(``executor.sim``).
"""
