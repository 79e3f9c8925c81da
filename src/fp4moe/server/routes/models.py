"""``/v1/models`` and ``/v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fp4moe.server.errors import ERROR_RESPONSES
from fp4moe.server.responses import ModelCard, ModelList
from fp4moe.server.serving import serving

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def models(request: Request):
    return ModelList(data=[_card(request)])


@router.get("/v1/models/{model_id}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def model(model_id: str, request: Request):
    serving(request).check_model(model_id)
    return _card(request)


def _card(request: Request) -> ModelCard:
    srv = serving(request)
    return ModelCard(id=srv.config.served_model_name, max_model_len=srv.llm.max_model_len)
