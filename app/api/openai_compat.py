"""Router for openai_compat (to be filled by its owner)."""

from fastapi import APIRouter

router = APIRouter()
