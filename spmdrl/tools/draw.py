"""The built-in ``draw_shape`` tool: draws the shape it is asked for and returns its picture, an image
observation a vision-language model reads in the tool message (docs/tools.md#image-observations).

It needs nothing but PIL, so the built-in tiny VLM (``model.path: tiny-vl``) can run tool rollouts with
images on a CPU; a real task's tool (a zoom into the prompt's picture, a chart of a query's result)
returns its images the same way, ``ToolResult(text, image=[...])``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spmdrl.tools.base import BaseTool, ToolError, ToolResult

SHAPES = ("square", "circle", "triangle")
COLORS = ("red", "green", "blue", "yellow", "black")


@dataclass(frozen=True)
class DrawLimits:
    size: int = 64  # the picture's side in pixels (a model's processor resizes it to its own)

    def check(self) -> None:
        if not 8 <= self.size <= 1024:
            raise ValueError(f"size must be between 8 and 1024 pixels, got {self.size}")


def draw_shape(shape: str, color: str, size: int = 64) -> Any:
    """A ``size`` x ``size`` white RGB picture with one ``color`` ``shape`` in its middle half."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(img)
    lo, hi = size // 4, size - size // 4 - 1
    if shape == "square":
        pen.rectangle([lo, lo, hi, hi], fill=color)
    elif shape == "circle":
        pen.ellipse([lo, lo, hi, hi], fill=color)
    else:
        pen.polygon([(size // 2, lo), (hi, hi), (lo, hi)], fill=color)
    return img


class DrawShapeTool(BaseTool):
    """Draws a shape (``square``, ``circle``, ``triangle``) in a colour and returns the picture with a line
    of text naming it; config: ``size`` (pixels). ``returns_images``: a text model is refused at start
    (spmdrl.rollout.rollout.check_image_tools)."""

    returns_images = True
    default_schema = {
        "type": "function",
        "function": {
            "name": "draw_shape",
            "description": "Draw a shape in a colour and show its picture.",
            "parameters": {
                "type": "object",
                "properties": {
                    "shape": {"type": "string", "enum": list(SHAPES), "description": "The shape to draw"},
                    "color": {"type": "string", "enum": list(COLORS), "description": "Its colour"},
                },
                "required": ["shape", "color"],
            },
        },
    }

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        from spmdrl.tools.builtin import limits_from_config  # builtin imports this module

        super().__init__(config, tool_schema)
        self.limits: DrawLimits = limits_from_config(DrawLimits, self.config, f"tool {self.name!r}")

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        shape, color = arguments.get("shape"), arguments.get("color")
        if shape not in SHAPES or color not in COLORS:
            raise ToolError(
                f"draw_shape takes a shape among {', '.join(SHAPES)} and a color among {', '.join(COLORS)}; "
                f"got shape={shape!r}, color={color!r}"
            )
        return ToolResult(f"A {color} {shape}.", image=[draw_shape(shape, color, self.limits.size)])
