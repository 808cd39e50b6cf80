"""`evaluate` metric: fraction of predictions mathematically equal to their references (math-verify).

Load it offline from the installed package:
    evaluate.load(str(importlib.resources.files("trl_qerl") / "metrics" / "math_accuracy"))
"""

import datasets
import evaluate

from trl_qerl.rewards import answers_match, extract_answer


_DESCRIPTION = "Accuracy of final answers extracted from model outputs (<answer>, ####, \\boxed{} or last number)."
_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[str]`): model outputs; the final answer is extracted from each.
    references (`list[str]`): gold answers.
Returns:
    accuracy (`float`): fraction of predictions equal to their reference (math-verify).
"""


class MathAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references):
        scores = [answers_match(gold, extract_answer(text)) for text, gold in zip(predictions, references)]
        return {"accuracy": sum(scores) / len(scores) if scores else 0.0}
