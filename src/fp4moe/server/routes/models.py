"""``/v1/models`` and ``/v1/models/{id}``: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Request

from fp4moe.server.serving import serving

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    srv = serving(request)
    return {
        "object": "list",
        "data": [
            {
                "id": srv.config.served_model_name,
                "object": "model",
                "created": 0,
                "owned_by": "fp4moe",
                "max_model_len": srv.llm.max_model_len,
            }
        ],
    }


@router.get("/v1/models/{model_id}")
async def model(model_id: str, request: Request):
    srv = serving(request)
    srv.check_model(model_id)
    return (await models(request))["data"][0]
