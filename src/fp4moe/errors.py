"""The errors a user can cause: the CLI prints them as one line and exits 2, with nothing written."""

from fp4moe.engine.multimodal import ImageError
from fp4moe.engine.prompts import PromptError
from fp4moe.formats.checkpoint import CheckpointError
from fp4moe.formats.nvfp4 import NVFP4Error
from fp4moe.models.qwen3_5_moe import UnsupportedModelError
from fp4moe.quantize.calib_data import CalibrationDataError
from fp4moe.quantize.pipeline import QuantizeError

USER_ERRORS = (
    CheckpointError,
    PromptError,
    ImageError,
    NVFP4Error,
    UnsupportedModelError,
    CalibrationDataError,
    QuantizeError,
    FileExistsError,
    FileNotFoundError,
    NotADirectoryError,
    ValueError,
)
