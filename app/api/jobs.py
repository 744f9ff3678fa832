"""Router for jobs (to be filled by its owner)."""

from fastapi import APIRouter

router = APIRouter()
