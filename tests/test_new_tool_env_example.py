"""The README's "Writing a new tool environment" example, run exactly as written (README.md
holds the same code; keep them identical)."""

# --- README example starts ---
import gymnasium as gym

from agentenv.envs.tool_env import ToolEnv
from agentenv.envs.tools import tool

PRICES = {"apple": 0.5, "bread": 2.25, "cheese": 7.8}
STOCK = {"apple": 120, "bread": 14, "cheese": 3}


@tool
def lookup(item: str, field: str = "price") -> float:
    """Look up a shop item's unit price (in euros) or how many are in stock.

    Args:
        item: Item name, e.g. "apple".
        field: "price" or "stock".
    """
    table = PRICES if field == "price" else STOCK
    return table[item]  # an unknown item raises KeyError; the model sees it as a tool error


class ShopEnv(ToolEnv):
    """What would it cost to buy every unit in stock? The answer needs two lookups per item."""

    def __init__(self, **kwargs):
        tasks = [{"question": f"What would it cost, in euros, to buy every {item} in stock?",
                  "answer": round(PRICES[item] * STOCK[item], 2), "type": "shop"} for item in PRICES]
        super().__init__(tasks, [lookup], max_turns=6, **kwargs)


gym.register("agentenv/Shop-v0", entry_point=ShopEnv)

env = gym.make("agentenv/Shop-v0")
obs, info = env.reset(seed=0, options={"task_index": 0})  # info["tools"] goes to apply_chat_template(tools=...)
obs, reward, terminated, truncated, info = env.step(
    '<tool_call>{"name": "lookup", "arguments": {"item": "apple"}}</tool_call>\n'
    '<tool_call>{"name": "lookup", "arguments": {"item": "apple", "field": "stock"}}</tool_call>')
print(obs)  # "[1] lookup:\n0.5\n\n[2] lookup:\n120" -- one "tool" message, results in call order
obs, reward, terminated, truncated, info = env.step("120 apples at 0.5 each: \\boxed{60}")
assert (reward, terminated, info["success"], info["tool_call_before_answer"]) == (1.0, True, True, True)
# --- README example ends ---


def test_readme_example_ran():
    assert "agentenv/Shop-v0" in gym.registry
    assert reward == 1.0 and info["success"]


def test_readme_example_passes_check_env():
    from gymnasium.utils.env_checker import check_env

    check_env(gym.make("agentenv/Shop-v0").unwrapped)


def test_readme_example_is_the_readme_file():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    source = Path(__file__).read_text()
    block = source.split("# --- README example starts ---\n", 1)[1].split("# --- README example ends ---", 1)[0]
    assert block.strip() in readme, "README.md's tool-env example and this test have drifted apart"
