"""Router for metrics (to be filled by its owner)."""

from fastapi import APIRouter

router = APIRouter()
