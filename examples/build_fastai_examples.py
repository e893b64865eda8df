"""Write the fastai example notebooks (outputs empty): ``python examples/build_fastai_examples.py``.

- ``fastai_pets_tiny.ipynb``: the shape of the course's lesson 1 (pets, cat or dog) on a toy
  dataset the notebook draws itself, packed as a .tgz and fetched with ``untar_data`` from a
  ``file://`` URL (nothing can be downloaded here; the download path is still exercised).
- ``fastai_tabular.ipynb``: ``TabularDataLoaders`` + ``tabular_learner`` on a synthetic
  adult-like dataframe.

Both run unchanged on the plain ``python3`` kernel and on Distributed Python:
``python -m dist_kernel run examples/fastai_pets_tiny.ipynb --ranks 2``.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

PETS = [
    new_markdown_cell(
        "# Is it a cat? (lesson 1, tiny)\n\n"
        "The course's first lesson on a toy dataset: cats are round, dogs are long, and as in the "
        "Oxford pets dataset a cat's file name starts with an upper-case letter. The notebook draws the "
        "images itself and packs them into a `.tgz` that `untar_data` fetches from a `file://` URL, "
        "standing in for the web. It runs unchanged on `python3` and on Distributed Python, where "
        "`fine_tune` trains data-parallel."),
    new_code_cell("from fastai.vision.all import *\nimport tarfile, tempfile\nfrom PIL import ImageDraw"),
    new_code_cell(
        "def make_tiny_pets(dest, n=240, size=40, seed=0):\n"
        "    \"Draw `n` toy pets into a .tgz at `dest`: round cats (Upper-case names), long dogs.\"\n"
        "    rng = np.random.default_rng(seed)\n"
        "    src = Path(tempfile.mkdtemp())/'tiny_pets'\n"
        "    (src/'images').mkdir(parents=True)\n"
        "    cats, dogs = ['Abyssinian', 'Bengal', 'Persian'], ['beagle', 'boxer', 'pug']\n"
        "    for i in range(n):\n"
        "        cat = i % 2 == 0\n"
        "        img = Image.new('RGB', (size, size), tuple(int(c) for c in rng.integers(0, 110, 3)))\n"
        "        r = int(rng.integers(size//5, size//3)); x, y = (int(v) for v in rng.integers(r, size-r, 2))\n"
        "        draw = ImageDraw.Draw(img)\n"
        "        fill = tuple(int(c) for c in rng.integers(140, 256, 3))\n"
        "        if cat: draw.ellipse([x-r, y-r, x+r, y+r], fill=fill)  # cats are round\n"
        "        else: draw.rectangle([x-r, y-r//3, x+r, y+r//3], fill=fill)  # dogs are long\n"
        "        img.save(src/'images'/f\"{(cats if cat else dogs)[i//2 % 3]}_{i}.png\")\n"
        "    part = Path(f'{dest}.{os.getpid()}.part')\n"
        "    with tarfile.open(part, 'w:gz') as tar: tar.add(src, arcname='tiny_pets')\n"
        "    os.replace(part, dest)  # atomic: whoever reads the archive never sees half of it\n"
        "    shutil.rmtree(src.parent)\n"
        "    return Path(dest)\n\n"
        "URL = make_tiny_pets(Path(tempfile.gettempdir())/'tiny_pets.tgz').as_uri()"),
    new_code_cell("path = untar_data(URL)/'images'\nfiles = get_image_files(path)\nlen(files)"),
    new_code_cell(
        "def is_cat(x): return x[0].isupper()\n\n"
        "dls = ImageDataLoaders.from_name_func(\n"
        "    path, get_image_files(path), valid_pct=0.2, seed=42,\n"
        "    label_func=is_cat, item_tfms=Resize(32), bs=16, num_workers=0)\n"
        "dls.show_batch(max_n=6, figsize=(6, 4))"),
    new_markdown_cell(
        "No pretrained weights can be downloaded here, so instead of `resnet34` the learner gets a small "
        "residual network built from scratch; `vision_learner` cuts it at its pooling layer and adds "
        "fastai's head, as it does for a resnet."),
    new_code_cell(
        "def tiny_resnet(pretrained=False):\n"
        "    return nn.Sequential(ConvLayer(3, 16, stride=2), ResBlock(1, 16, 32, stride=2),\n"
        "                         ResBlock(1, 32, 64, stride=2), nn.AdaptiveAvgPool2d(1), Flatten(), nn.Linear(64, 10))\n\n"
        "learn = vision_learner(dls, tiny_resnet, metrics=error_rate, pretrained=False)"),
    new_code_cell("learn.lr_find(num_it=30)"),
    new_code_cell("learn.fine_tune(3, base_lr=1e-2)"),
    new_code_cell("learn.show_results(max_n=6, figsize=(6, 4))"),
    new_code_cell("interp = ClassificationInterpretation.from_learner(learn)\ninterp.plot_confusion_matrix()"),
    new_code_cell("interp.plot_top_losses(4, nrows=1, figsize=(6, 2))"),
    new_code_cell(
        "is_cat_, _, probs = learn.predict(files[0])\n"
        "print(f'{files[0].name}: is this a cat? {is_cat_}.')\n"
        "print(f\"Probability it's a cat: {probs[1].item():.4f}\")"),
    new_code_cell(
        "learn.export('tiny_pets.pkl')\n"
        "learn_inf = load_learner(path/'tiny_pets.pkl')\n"
        "learn_inf.predict(files[1])[0]"),
]

TABULAR = [
    new_markdown_cell(
        "# Tabular: who earns more than 50k? (synthetic)\n\n"
        "The course's tabular example on a synthetic, adult-shaped dataframe. The split is "
        "`from_df`'s unseeded random split: on Distributed Python every rank starts with the same "
        "seed, so every rank draws the same split."),
    new_code_cell("from fastai.tabular.all import *\nimport tempfile"),
    new_code_cell(
        "rng = np.random.default_rng(0)\n"
        "n = 2000\n"
        "df = pd.DataFrame({\n"
        "    'age': rng.integers(17, 80, n).astype(float),\n"
        "    'hours_per_week': rng.integers(10, 70, n).astype(float),\n"
        "    'education': rng.choice(['HS-grad', 'Some-college', 'Bachelors', 'Masters', 'Doctorate'], n),\n"
        "    'workclass': rng.choice(['Private', 'Self-emp', 'Gov'], n),\n"
        "    'sex': rng.choice(['Female', 'Male'], n)})\n"
        "edu = df.education.map({'HS-grad': -1, 'Some-college': -.5, 'Bachelors': .5, 'Masters': 1, 'Doctorate': 1.5})\n"
        "score = (df.age - 40)/15 + (df.hours_per_week - 40)/15 + edu + rng.normal(0, .5, n)\n"
        "df['salary'] = np.where(score > .5, '>=50k', '<50k')\n"
        "df.loc[rng.choice(n, 60, replace=False), 'age'] = np.nan  # FillMissing has work to do\n"
        "df.head()"),
    new_code_cell(
        "path = Path(tempfile.gettempdir())/'tabular_example'\n"
        "dls = TabularDataLoaders.from_df(df, path=path, y_names='salary',\n"
        "    cat_names=['workclass', 'education', 'sex'], cont_names=['age', 'hours_per_week'],\n"
        "    procs=[Categorify, FillMissing, Normalize], bs=64)\n"
        "dls.show_batch(max_n=3)"),
    new_code_cell("learn = tabular_learner(dls, layers=[64, 32], metrics=accuracy)\nlearn.lr_find()"),
    new_code_cell("learn.fit_one_cycle(3, 1e-2)"),
    new_code_cell("learn.recorder.plot_loss()"),
    new_code_cell("learn.show_results(max_n=4)"),
    new_code_cell("preds, targs = learn.get_preds()\nprint(len(preds), 'rows, accuracy', accuracy(preds, targs).item())"),
    new_code_cell("learn.save('tabular')\nlearn = learn.load('tabular')\nrow, clas, probs = learn.predict(df.iloc[0])\nrow.show()\nclas, probs"),
]


def write(name: str, cells: list) -> Path:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}})
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: rebuilding changes only what changed
    out = HERE / name
    nbformat.write(nb, out)
    return out


if __name__ == "__main__":
    for name, cells in (("fastai_pets_tiny.ipynb", PETS), ("fastai_tabular.ipynb", TABULAR)):
        print("wrote", write(name, cells))
