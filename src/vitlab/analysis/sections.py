"""What report.html shows, one function per section, in the order of ``SECTIONS``.

A section reads what it needs from the ``Inspection`` (the model, the shown images, the options, and what several
sections share, computed once on first use) and adds figures (``r.figure``: a Figure, its PNG file, a title and a
caption), notes, tables or summary entries. Its caption is the template beside it. A section that does not apply
to the model adds a note saying why, and nothing else. A new section is one function and one entry in SECTIONS.
"""
from __future__ import annotations

import html
import json
from typing import TYPE_CHECKING

import torch

from ..atomic import atomic_write_bytes
from ..models.layers import PatchEmbed
from . import plots
from .capture import attention_modules
from .distance import convit_gates, gpsa_positional_attention, positional_attention_distance
from .embeddings import filter_components, position_similarity, rotary_similarity
from .explain import REGISTRY, explain, method_key, method_label
from .faithfulness import METRICS
from .interactive import explorer_data, explorer_html
from .libragrad import IG_STEPS
from .pretraining import mae_reconstructions, mpp_predictions
from .sanity import head_importance, parameter_randomisation

if TYPE_CHECKING:
    from .inspection import Inspection

PATCH_GRID = ("What the model reads: each image is cut into a {gh}x{gw} grid of {ph}x{pw}-pixel patches, numbered in "
              "the order they enter the encoder (row by row){numbers}. Each patch is flattened and projected to one "
              "token; {prefix} Below: the first image as that sequence.{hybrid}")
PATCH_GRID_HYBRID = (" In this hybrid a ResNet makes the grid: each token is one cell of its {gh}x{gw} output (stride "
                     "{ph}), and sees a wider region of the image than its cell.")


def patch_grid(r: Inspection) -> None:
    """The first figure of every ViT tutorial: a few shown images with the model's patch grid over them."""
    embed = getattr(r.model, "patch_embed", None)
    if embed is None or getattr(embed, "patch_size", None) is None:
        r.note("The image cut into patches: skipped, the model has no patch embedding (it reads pixels, not patches).")
        return
    ph, pw = embed.patch_size
    gh, gw = r.images.shape[2] // ph, r.images.shape[3] // pw
    prefix = r.prefix
    k = min(len(r.images), 4)
    pixels = isinstance(embed, PatchEmbed) or hasattr(embed, "conv_weight")  # a conv or linear layer on the pixels
    caption = PATCH_GRID.format(
        gh=gh, gw=gw, ph=ph, pw=pw, numbers="" if gh * gw <= 64 else " (numbers drawn up to 64 patches)",
        prefix=(f"the learnt {' and '.join(f'[{t}]' for t in prefix)} "
                f"{'tokens go' if len(prefix) > 1 else 'token goes'} first, then the patches." if prefix else
                "there is no class token: the patches alone make the sequence."),
        hybrid="" if pixels else PATCH_GRID_HYBRID.format(gh=gh, gw=gw, ph=ph))
    r.figure(plots.plot_patch_grid(r.display[:k], (ph, pw), r.names[:k], prefix), "patch_grid.png",
             "The image cut into its patch grid", caption)


MAE_RECONSTRUCTIONS = (
    "What the masked autoencoder learnt: each row is one test image, masked at random ({ratio:.0%} of its patches "
    "hidden, the same draw on every run: seed {seed}). The encoder sees only the visible patches (second column, "
    "hidden ones grey); the decoder predicts every patch's pixels (third){norm}. The last column pastes the visible "
    "patches over the prediction, as in the MAE paper's figures. Under each image: its loss, the mean squared error "
    "over its hidden patches{target}.")
MPP_PREDICTIONS = (
    "What masked patch prediction learnt: each row is one test image, {ratio:.0%} of whose patches are corrupted "
    "(outlined; the same draw on every run: seed {seed}): {mask:.0%} of them replaced by the learnt [mask] "
    "embedding (grey in the second column), {swap:.0%} by another patch of the image, the rest left as they are. "
    "The objective predicts each corrupted patch's mean colour, {bits} bits per channel ({classes} classes): the "
    "third column fills every patch with its true mean colour, the last puts the predicted one in the corrupted "
    "patches. Under each image: the share of its corrupted patches whose colour class is predicted exactly.")
PRETRAIN_SEED = 0


def pretraining(r: Inspection) -> None:
    """A pre-training run's objective on a few shown images: MAE's reconstructions, or MPP's mean colours."""
    objective = r.objective
    if objective is None:
        r.note("Pre-training reconstructions: skipped, the model is not a pre-training run (vitlab pretrain).")
        return
    k = min(len(r.images), 6)
    images = r.images[:k]
    if hasattr(objective, "decoder"):  # a masked autoencoder
        rec = mae_reconstructions(objective, images, r.mean, r.std, PRETRAIN_SEED)
        rows = [f"{n}\nloss {v:.3f}" for n, v in zip(r.names, rec.loss)]
        r.summary["pretraining"] = {"method": "mae", "mask_ratio": rec.mask_ratio, "seed": PRETRAIN_SEED,
                                    "loss": rec.loss}
        norm = objective.norm_pix_loss
        r.figure(plots.plot_mae_reconstructions(rec.images, rec.masked, rec.reconstructed, rec.pasted, rows),
                 "mae_reconstructions.png", "MAE reconstructions", MAE_RECONSTRUCTIONS.format(
                     ratio=rec.mask_ratio, seed=PRETRAIN_SEED,
                     norm=", each patch's prediction put back into the patch's true mean and spread (the model "
                          "predicts normalised pixels: it learns a patch's structure, not its brightness)" if norm
                     else "", target=" (in per-patch normalised pixels)" if norm else ""))
        return
    if not hasattr(objective, "corrupt_ratio"):  # self-distillation (DINO): nothing of the images is predicted
        r.note(f"Pre-training reconstructions: skipped, a {objective.method.upper()} run predicts no pixels; its "
               "encoder's attention is in the sections below.")
        return
    pred = mpp_predictions(objective, images, r.mean, r.std, PRETRAIN_SEED)
    rows = [f"{n}\n{v:.0%} exact" for n, v in zip(r.names, pred.accuracy)]
    r.summary["pretraining"] = {"method": "mpp", "seed": PRETRAIN_SEED, "accuracy": pred.accuracy}
    r.figure(plots.plot_mpp_predictions(pred.images, pred.corrupted, pred.true, pred.predicted, pred.corrupted_mask,
                                        pred.patch_size, rows), "mpp_predictions.png",
             "Masked patch prediction: mean colours", MPP_PREDICTIONS.format(
                 ratio=objective.corrupt_ratio, seed=PRETRAIN_SEED, mask=objective.mask_prob,
                 swap=objective.random_prob, bits=objective.bits, classes=objective.num_colors))


def needs_classifier(r: Inspection, what: str) -> bool:
    """Whether a section that reads class scores can run; if not, a note says why it was skipped."""
    if r.no_classifier:
        r.note(f"{what}: skipped, {r.no_classifier}.")
        return False
    return True


ATTENTION_HEADS = (
    "Each row is one block (input at the top), each column one head. A panel is the patch grid of the input and "
    "shows {query}; blocks that have no class token yet (ConViT's GPSA blocks, CaiT's self-attention blocks) show "
    "the mean over the patch queries, i.e. how much attention each patch receives. Every panel is divided by its "
    "own maximum: a uniformly bright panel is a head that attends everywhere, a single bright cell one that "
    "attends to one patch.")


def attention_heads(r: Inspection) -> None:
    """One image's attention per block and head, for the first max_head_figures images."""
    query = ("the class token's row of the attention (its attention to each patch)" if "cls" in r.prefix else
             "the mean over the patch queries (this model has no class token)")
    n = min(len(r.images), r.max_head_figures)
    for i in range(n):
        top = r.predictions[i]["top"]
        fig = plots.plot_attention_heads(r.maps, i, r.display[i], title=f"Attention per block and head: {r.names[i]}"
                                         + (f" (predicted {top[0][0]})" if top else ""))
        r.figure(fig, f"attention_heads_{i}.png", f"Attention per block and head: {r.names[i]}",
                 ATTENTION_HEADS.format(query=query))
    if len(r.images) > n:
        r.note(f"Per-head attention figures are drawn for the first {n} of the {len(r.images)} images.")


EXPLANATIONS = (
    "{count} ways to ask which patches the prediction rests on, for the {token}: {methods}. {agnostic} the same for "
    "every class; the others explain the predicted class. Red (jet) marks the most relevant patches; each map is "
    "scaled to its own range. Under each map: its deletion and insertion AUC on that image (see Faithfulness).{dist}")
COUNTS = {2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six", 7: "Seven", 8: "Eight", 9: "Nine", 10: "Ten",
          11: "Eleven", 12: "Twelve"}


def _and(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def explanations(r: Inspection) -> None:
    """Every registered explanation method's map of the shown images, with its deletion and insertion AUC."""
    if r.no_classifier:
        class_agnostic_explanations(r)
        return
    per_image = r.faith_per_image
    row_label = {k: method_label(k).replace(" (", "\n(", 1) for k in r.explanations}
    masks = {row_label[k]: v for k, v in r.explanations.items()}
    scores = {row_label[k]: [f"del {s['deletion_auc']:.2f} / ins {s['insertion_auc']:.2f}" for s in per_image[k]]
              for k in r.explanations}
    captions = [f"{r.names[i]}\n{p['top'][0][0]} ({p['top'][0][1]:.0%})" for i, p in enumerate(r.predictions)]
    used = [REGISTRY[m] for m in dict.fromkeys(m for m, _ in r.pairs)]
    agnostic = [m.label for m in used if not m.class_specific]
    caption = EXPLANATIONS.format(
        count=COUNTS.get(len(used), str(len(used))),
        token="class token" if "cls" in r.prefix else "mean of patch queries",
        methods=_and([m.about.format(head_fusion=r.head_fusion, discard_ratio=r.discard_ratio) for m in used]),
        agnostic=(_and(agnostic)[:1].upper() + _and(agnostic)[1:] + (" are" if len(agnostic) > 1 else " is"))
        if agnostic else "No map is",
        dist=" The distillation-token rows read the same methods from DeiT's distillation token."
        if "dist" in r.prefix else "")
    r.figure(plots.plot_rollout(r.display, masks, captions, title="Attention rollout and relevance", scores=scores),
             "rollout.png", "Attention rollout and relevance", caption)


def class_agnostic_explanations(r: Inspection) -> None:
    """A model without a trained classifier (a backbone, a pre-training run's encoder): the maps that read no class
    (attention rollout, raw attention), without faithfulness scores, which need class probabilities."""
    pairs = [(m, t) for m, t in r.pairs if not REGISTRY[m].class_specific]
    r.note(f"Relevance and faithfulness: skipped, {r.no_classifier}; the class-agnostic maps are drawn.")
    if not pairs:
        return
    anyclass = torch.zeros(len(r.images), dtype=torch.long, device=r.images.device)  # read by no agnostic method
    masks = {method_label(method_key(m, t)).replace(" (", "\n(", 1): explain(
        r.model, r.images, m, anyclass, token=t, head_fusion=r.head_fusion, discard_ratio=r.discard_ratio)
        for m, t in pairs}
    used = [REGISTRY[m] for m in dict.fromkeys(m for m, _ in pairs)]
    r.figure(plots.plot_rollout(r.display, masks, r.names, title="Attention rollout"), "rollout.png",
             "Attention rollout", _and([m.about.format(head_fusion=r.head_fusion, discard_ratio=r.discard_ratio)
                                        for m in used]) + ". These maps read no class: the model has no classifier.")


FAITHFULNESS = (
    "Over {images} image(s). Deletion/insertion (RISE, Petsiuk et al. 2018): the probability of the class "
    "predicted on the intact image as patches are replaced by the '{deletion_baseline}' baseline (deletion) or "
    "revealed over a '{insertion_baseline}' copy (insertion; blur sigma {blur_sigma_px:.1f} px), most relevant "
    "first; a faithful map gives a low deletion and a high insertion area. Positive/negative perturbation (Chefer "
    "et al. 2021): top-1 accuracy ({accuracy_against}) after blacking out 10%..90% of the patches, the most "
    "(positive: lower is better) or least (negative: higher is better) relevant first; AUC by the trapezoid rule "
    "with the unperturbed point. ROAD (Rong et al. 2022): the same accuracy with the removed patches filled by "
    "noisy linear imputation (each pixel the weighted mean of its neighbours, plus a little noise), which leaves "
    "no mask shape to read; MoRF (most relevant first: lower is better) and LeRF (least relevant first: higher is "
    "better). SaCo (Wu et al. 2024): whether the map's salience of ten equal groups of pixels tracks the drop each "
    "group's removal causes, in [-1, 1] (higher is better; a map unrelated to the model scores about 0). The grey "
    "dotted line is a random map, the grey dash-dotted one an edge detector (Sobel magnitude per patch): the floors "
    "every method should beat. Every parameter is in faithfulness.json.")


def faithfulness_table(result: dict) -> str:
    """An HTML table: one row per method, its mean deletion/insertion AUC and perturbation AUCs."""
    e = html.escape
    rows = "\n".join(
        f"<tr><td>{e(m['label'])}</td><td>{m['deletion_auc']:.3f}</td><td>{m['insertion_auc']:.3f}</td>"
        f"<td>{m['positive_auc']:.2f}</td><td>{m['negative_auc']:.2f}</td>"
        f"<td>{m['road_morf_auc']:.2f}</td><td>{m['road_lerf_auc']:.2f}</td><td>{m.get('saco', float('nan')):.3f}"
        "</td></tr>" for m in result["methods"].values())
    return ("<table><tr><th>method</th><th>deletion AUC &darr;</th><th>insertion AUC &uarr;</th>"
            "<th>positive perturbation AUC &darr;</th><th>negative perturbation AUC &uarr;</th>"
            "<th>ROAD MoRF AUC &darr;</th><th>ROAD LeRF AUC &uarr;</th><th>SaCo &uarr;</th></tr>"
            f"{rows}</table>")


def faithfulness(r: Inspection) -> None:
    """Deletion/insertion and perturbation curves of every method: faithfulness.json, a figure and a table."""
    if not needs_classifier(r, "Faithfulness"):
        return
    faith = r.faith
    atomic_write_bytes(r.out / "faithfulness.json", (json.dumps(faith, indent=1) + "\n").encode("utf-8"))
    r.summary["faithfulness"] = {k: {m: v[m] for m in METRICS} for k, v in faith["methods"].items()}
    proto = faith["protocol"]
    r.figure(plots.plot_faithfulness(faith), "faithfulness.png", "Faithfulness",
             FAITHFULNESS.format(images=proto["images"], **proto["deletion_insertion"],
                                 accuracy_against=proto["perturbation"]["accuracy_against"]))
    r.tables.append((f"Faithfulness over {proto['images']} image(s) (faithfulness.json)", faithfulness_table(faith)))


RANDOMISATION = (
    "The model-parameter randomisation test (Adebayo et al. 2018) on {images} image(s): the weights are re-drawn at "
    "random from the top down (the classifier head first, then each block from the last, then the embeddings), and "
    "each method's map is compared with the trained model's by Spearman rank correlation. A map that explains the "
    "model loses its shape; one that stays similar once every block is random (correlation >= {threshold}) "
    "reflects the input more than the model and is flagged.{ig}")


def randomisation(r: Inspection) -> None:
    """The cascading parameter-randomisation sanity check of every method; flagged methods become notes."""
    if not needs_classifier(r, "Sanity check: parameter randomisation"):
        return
    original = {k: v[:r.sanity_images] for k, v in r.explanations.items()}  # the trained model's, drawn already
    sanity = parameter_randomisation(r.model, r.images[:r.sanity_images], r.pairs, head_fusion=r.head_fusion,
                                     discard_ratio=r.discard_ratio, original=original, progress=True)
    r.summary["randomisation"] = sanity
    labels = {k: method_label(k) for k in r.explanations}
    r.figure(plots.plot_randomisation(sanity, labels), "randomisation.png", "Sanity check: parameter randomisation",
             RANDOMISATION.format(images=sanity["images"], threshold=sanity["threshold"],
                                  ig=f" LibraGrad integrated gradients is drawn here with {sanity['ig_steps']} path "
                                     f"points, trained and randomised alike (its map above: {IG_STEPS})."
                                  if any(m == "libragrad_ig" for m, _ in r.pairs) else ""))
    for k in sanity["flagged"]:
        r.note(f"Sanity check: {labels[k]} does not change when the model's weights are randomised (rank correlation "
               f"{sanity['correlation'][k][-2]:.2f} with every block random): it is flagged as not explaining the "
               "model.")
    agnostic = [labels[k] for k in sanity["class_agnostic"]]
    if agnostic:
        r.note("Class-agnostic (unchanged when the classifier head is randomised): " + ", ".join(agnostic) + ".")


ATTENTION_DISTANCE = (
    "As in the ViT paper (Fig. 11): for each head, the attention-weighted distance in pixels between a query patch's "
    "centre and the patches it attends to, averaged over queries and {images} image(s). Only patch-to-patch "
    "attention counts (prefix tokens dropped, rows renormalised); class-attention blocks are left out. One dot per "
    "head; the dashed line is the distance of uniform attention. Low dots are local heads (like convolutions), high "
    "dots global ones; trained ViTs mix both in early layers and become global with depth.")


def attention_distance(r: Inspection) -> None:
    """Each head's mean attention distance in pixels, per block (ViT paper, Fig. 11)."""
    names, kinds = zip(*r.distance_layers)
    r.summary["mean_attention_distance_px"] = {n: d.tolist() for n, d in zip(names, r.distances)}
    embed = r.model.patch_embed
    r.figure(plots.plot_attention_distance(r.distances, kinds, embed.grid_size, embed.patch_size),
             "attention_distance.png", "Mean attention distance",
             ATTENTION_DISTANCE.format(images=len(r.distance_set)))


HEAD_IMPORTANCE = (
    "For each block and head, how much the logit of the predicted class drops when that head's attention is zeroed "
    "(so it adds nothing to its block's output), mean over {images} image(s); red: the head helps the prediction, "
    "blue: removing it raises the logit. Right: the same heads' mean attention distance, to see whether the heads "
    "that matter are local or global.")


def importance(r: Inspection) -> None:
    """The logit drop when each head is zeroed, beside the heads' mean attention distance."""
    if not needs_classifier(r, "Head importance"):
        return
    shown = r.distance_set[:r.importance_images]
    scores, block_names = head_importance(r.model, shown, batch_size=r.batch_size, progress=True)
    r.summary["head_importance"] = {n: s[~s.isnan()].tolist() for n, s in zip(block_names, scores)}
    r.figure(plots.plot_head_importance(scores, block_names, r.distances, [n for n, _ in r.distance_layers]),
             "head_importance.png", "Head importance", HEAD_IMPORTANCE.format(images=len(shown)))


POSITION_SIMILARITY = (
    "As in the ViT paper (Fig. 7, centre): tile (r, c) shows the cosine similarity between the position embedding of "
    "the patch in row r, column c and that of every patch. A learned embedding that encodes 2D position shows a "
    "bright spot at the tile's own place that fades with distance, often with row and column structure; a random "
    "one shows noise.")


ROTARY_SIMILARITY = (
    "{table}Its attention rotates each patch's queries and keys by angles set by the patch's coordinates (RoPE, "
    "{family}). Tile (r, c) shows the cosine similarity of the rotation of the patch in row r, column c (its sines and "
    "cosines over every frequency{mixed}) with every patch's: the mean cosine of their angle differences, what "
    "position alone adds to the attention score of a query and a key that are otherwise alike. It has no "
    "parameters{learned}; it depends on the offset between patches only, so every tile is the same pattern moved.")


def position_embedding(r: Inspection) -> None:
    """Cosine similarity of the position embeddings (ViT paper, Fig. 7 centre), and of the rotary embedding that
    replaces or joins them in RoPE models."""
    table = getattr(r.model, "pos_embed", None) is not None
    rotary = r.model.rotary_embedding() if hasattr(r.model, "rotary_embedding") else None
    if table:
        r.figure(plots.plot_position_similarity(position_similarity(r.model)), "position_similarity.png",
                 "Position embedding similarity", POSITION_SIMILARITY)
    elif rotary is None:
        r.note("Position embedding similarity: skipped, the model has no position embedding.")
    if rotary is not None:
        mixed = getattr(getattr(r.model, "rope", None), "freqs", None) is not None
        caption = ROTARY_SIMILARITY.format(
            table="" if table else "This model has no position table: nothing is added to the patch tokens. ",
            family=r.model.family, mixed=", in every block and head" if mixed else "",
            learned=" but its frequencies, learned per block and head" if mixed else "")
        r.figure(plots.plot_position_similarity(rotary_similarity(r.model), "Rotary embedding similarity"),
                 "rotary_similarity.png", "Rotary position embedding (no position table)" if not table else
                 "Rotary position embedding", caption)


EMBEDDING_FILTERS = (
    "As in the ViT paper (Fig. 7, left): the top {k} principal components of the {filters} linear patch-embedding "
    "filters, each shown as a {ph}x{pw} patch (colours are the filter's RGB weights for 3-channel models, min-max "
    "scaled per component). Trained models show smooth, Gabor- or DCT-like bases; random weights show noise.")


def embedding_filters(r: Inspection) -> None:
    """Principal components of the linear patch-embedding filters (ViT paper, Fig. 7 left)."""
    embed = r.model.patch_embed
    if not isinstance(embed, PatchEmbed) and not hasattr(embed, "conv_weight"):
        r.note("Patch-embedding filters: skipped, the patch embedding of a hybrid is a ResNet followed by a 1x1 "
               "projection, not filters over pixels.")
        return
    weight = embed.conv_weight() if hasattr(embed, "conv_weight") else embed.proj.weight  # a linear one: as filters
    comps, var = filter_components(weight, 28)
    r.figure(plots.plot_embedding_filters(comps, var), "embedding_filters.png", "Patch-embedding filter components",
             EMBEDDING_FILTERS.format(k=len(comps), filters=weight.shape[0], ph=embed.patch_size[0],
                                      pw=embed.patch_size[1]))


CONVIT_GATES = (
    "Each GPSA head mixes content attention and positional attention with the gate sigmoid(lambda) (left; 1 = purely "
    "positional, 0 = purely content, sigmoid(1) = 0.73 at init). Right: the mean distance in pixels of each head's "
    "positional branch alone; small values are local, convolution-like heads. Trained ConViTs let later GPSA layers "
    "drift to content (low gates).")
CONVIT_POSITIONAL = (
    "For each GPSA layer and head, the positional attention softmax(pos_proj(relative offsets)) of the centre patch "
    "(+) over the patch grid, with its mean distance. At init the heads form the offsets of a convolution kernel.")


def convit(r: Inspection) -> None:
    """ConViT's gates and the positional attention of its GPSA heads."""
    if not any(k == "gpsa" for _, k, _ in attention_modules(r.model)):
        r.note("ConViT gates: skipped, the model has no gated positional self-attention (not a ConViT).")
        return
    gates, pos_dist = convit_gates(r.model), positional_attention_distance(r.model)
    r.summary["convit_gates"], r.summary["positional_attention_distance_px"] = gates.tolist(), pos_dist.tolist()
    r.figure(plots.plot_convit_gates(gates, pos_dist), "convit_gates.png", "ConViT gates", CONVIT_GATES)
    r.figure(plots.plot_gpsa_positional(gpsa_positional_attention(r.model), r.model.patch_embed.grid_size, pos_dist),
             "convit_positional.png", "ConViT positional attention", CONVIT_POSITIONAL)


CAIT_CLASS_ATTENTION = (
    "CaiT's class token only enters in the final class-attention blocks, where it alone queries the [class, patches] "
    "tokens. Each row is one image and class-attention block, each column a head: the class token's attention to "
    "the patches (scaled to the panel's maximum); 'self' is its weight on itself. Talking-heads self-attention rows "
    "in the other figures do not sum exactly to 1 (the post-softmax head mixing proj_w is linear), and are shown as "
    "they are.")


def cait_class_attention(r: Inspection) -> None:
    """CaiT's class-attention blocks, per image and head."""
    if not any(m.kind == "class_attn" for m in r.maps):
        r.note("CaiT class attention: skipped, the model has no class-attention blocks (not a CaiT).")
        return
    r.figure(plots.plot_class_attention(r.maps, r.display, list(range(min(len(r.images), 4)))),
             "cait_class_attention.png", "CaiT class attention", CAIT_CLASS_ATTENTION)


def explorer(r: Inspection) -> None:
    """The interactive attention explorer: every block's and head's attention and every map of a few images."""
    if not needs_classifier(r, "The interactive attention explorer"):
        return
    methods = {k: (method_label(k), v) for k, v in r.explanations.items()}
    captions = [f"{r.names[i]}: predicted {p['top'][0][0]} ({p['top'][0][1]:.0%})"
                + (f", true {p['label']}" if p.get("label") else "") for i, p in enumerate(r.predictions)]
    data = explorer_data(r.maps, r.display, r.names, captions, methods, r.faith_per_image,
                         {k: v for k, v in r.faith["methods"].items() if k in methods}, max_images=r.explorer_images)
    r.explorer = explorer_html(data)


TOKEN_MIXING = (
    "The attention maps of an MLP-Mixer (Tolstikhin et al. 2021, Fig. 5): each panel is one hidden unit of the "
    "first token-mixing layer of a block (rows: blocks {blocks}), its weights over the {gh}x{gw} patch grid "
    "(blue negative, red positive, scaled per panel). What attention decides per image, the Mixer learns once "
    "for every image: trained models show local, blob- and stripe-like fields in the first blocks and wider ones "
    "later; random weights show noise.")


def token_mixing(r: Inspection) -> None:
    """MLP-Mixer's token-mixing weights drawn as maps over the patch grid (its paper's Fig. 5)."""
    if not hasattr(r.model, "token_mixing_weights"):
        r.note("Token-mixing weights: skipped, the model mixes its tokens with attention (not an MLP-Mixer).")
        return
    depth = len(r.model.blocks)
    blocks = sorted({0, depth // 2, depth - 1})
    maps = [r.model.token_mixing_weights(b)[:8].float().cpu().numpy() for b in blocks]
    gh, gw = maps[0].shape[1:]
    r.figure(plots.plot_token_mixing(maps, [f"block {b}" for b in blocks]), "token_mixing.png",
             "Token-mixing weights", TOKEN_MIXING.format(blocks=", ".join(map(str, blocks)), gh=gh, gw=gw))


# what a model without attention skips (one note names them); the sections it gets instead
ATTENTION_ONLY = ("Attention per head, rollout, relevance and the other explanation maps, faithfulness, the "
                  "randomisation check, attention distance, head importance and the explorer")
ATTENTION_FREE_SECTIONS = (patch_grid, token_mixing, position_embedding, embedding_filters)
SECTIONS = (patch_grid, pretraining, attention_heads, explanations, faithfulness, randomisation, attention_distance,
            importance, position_embedding, embedding_filters, convit, cait_class_attention, explorer)
