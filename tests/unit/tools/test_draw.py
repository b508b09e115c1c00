"""The built-in ``draw_shape`` tool (spmdrl/tools/draw.py) and tool results with images
(spmdrl/tools/base.py: ToolResult.image, verl's ToolResponse.image)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from PIL import Image

from spmdrl.errors import ConfigError
from spmdrl.tools import ToolError, ToolExecutor, ToolResult, load_tools
from spmdrl.tools.base import coerce_result
from spmdrl.tools.draw import DrawShapeTool
from spmdrl.tools.parser import ToolCall


def test_draw_shape_is_a_builtin_that_returns_its_picture() -> None:
    tools = load_tools(["draw_shape"])
    assert getattr(tools["draw_shape"], "returns_images", False)
    (ok, bad) = ToolExecutor(tools).run(
        [
            ToolCall("draw_shape", {"shape": "circle", "color": "blue"}),
            ToolCall("draw_shape", {"shape": "hex"}),
        ]
    )
    assert ok.status == "ok" and ok.text == "A blue circle."
    (img,) = ok.images
    assert img.size == (64, 64) and img.mode == "RGB"
    assert img.getpixel((32, 32)) == (0, 0, 255) and img.getpixel((1, 1)) == (255, 255, 255)
    # The tool message: the image part before the text, as the chat template renders it.
    assert [p["type"] for p in ok.message()["content"]] == ["image", "text"]
    assert bad.status == "invalid" and "shape" in bad.text and not bad.images
    # Its own check, for a caller that skips the executor's schema check; and its config.
    with pytest.raises(ToolError, match="a shape among square, circle, triangle"):
        DrawShapeTool().execute("i", {"shape": "hex", "color": "red"})
    big = DrawShapeTool({"size": 100}).execute("i", {"shape": "triangle", "color": "red"})
    assert big.image[0].size == (100, 100)
    with pytest.raises(ConfigError, match="between 8 and 1024"):
        DrawShapeTool({"size": 4})


@dataclass
class _VerlToolResponse:  # verl's ToolResponse's fields (text, image, video)
    text: str | None = None
    image: Any = None
    video: Any = None


def test_tool_results_carry_images_as_verls_tool_response_does() -> None:
    red = Image.new("RGB", (8, 8), "red")
    grey = Image.new("L", (8, 8), 128)
    assert coerce_result(_VerlToolResponse("a", image=[red, grey])).image[1].mode == "RGB"  # converted
    assert coerce_result(_VerlToolResponse("a", image=red)).image == [red]  # one image
    assert coerce_result((_VerlToolResponse("a", image=[red]), 1.0, {})).image == [red]  # verl's tuple
    assert coerce_result({"text": "a", "image": [red]}).image == [red]
    assert coerce_result(ToolResult("a", image=[red])).image == [red]
    assert coerce_result("a").image == []
    with pytest.raises(TypeError, match="image 0 is a str; expected a PIL image"):
        coerce_result(ToolResult("a", image=["cat.png"]))
    with pytest.raises(TypeError, match="video observations are not supported"):
        coerce_result(_VerlToolResponse("a", video=[red]))
