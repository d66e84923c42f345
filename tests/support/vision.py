"""Small vision models with norms, for the mixed-precision and plan tests.

``TinyResNet`` (plain modules) is what ``fp32_modules`` keeps in fp32;
``ConvBNClassifier`` and ``TinyImages`` are a vision model and dataset as
mmpretrain's configs give them (BatchNorm buffers, images stacked by the data
preprocessor), registered for configs that name them (``custom_imports=['vision']``).
"""
import torch
import torch.nn.functional as F
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, MODELS
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import Dataset


class Block(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the identity."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    """Stem (conv + BN, in the root unit), two blocks, global pooling, a linear head."""

    def __init__(self, channels: int = 8, classes: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.blocks = nn.Sequential(Block(channels), Block(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.head(x.mean((2, 3)))


class GroupNormNet(nn.Module):
    """Conv + GroupNorm + LayerNorm + linear: norms a user adds to ``fp32_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.gn(self.conv(x)).mean((2, 3))))


def tiny_resnet(seed: int = 0) -> TinyResNet:
    """A ``TinyResNet`` seeded with ``seed``, its norms' affine parameters away from 1 and 0."""
    torch.manual_seed(seed)
    model = TinyResNet()
    for m in model.modules():  # BN affine parameters away from 1 / 0, so they matter
        if isinstance(m, _BatchNorm):
            nn.init.uniform_(m.weight, 0.5, 1.5)
            nn.init.uniform_(m.bias, -0.2, 0.2)
    return model


@MODELS.register_module(force=True)
class ConvBNClassifier(BaseModel):
    """BatchNorm (plain buffers, or SyncBatchNorm) and images stacked by the data preprocessor."""

    def __init__(self, data_preprocessor=None, width=8, classes=4, sync_bn=False):
        super().__init__(data_preprocessor=data_preprocessor)
        norm = nn.SyncBatchNorm if sync_bn else nn.BatchNorm2d
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), norm(width), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(width, width, 3, padding=1), norm(width), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.head(self.block(self.stem(inputs)).mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, torch.as_tensor(data_samples)))
        return logits


@DATASETS.register_module(force=True)
class TinyImages(Dataset):
    """Eight constant uint8 images of 32 x 32 with labels 0-3."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return dict(inputs=torch.full((3, 32, 32), i, dtype=torch.uint8), data_samples=i % 4)


PREPROCESSOR = dict(type='ImgDataPreprocessor', mean=[123.675, 116.28, 103.53],
                    std=[58.395, 57.12, 57.375])
IMAGES = dict(batch_size=4, dataset=dict(type='TinyImages'),
              collate_fn=dict(type='pseudo_collate'))


class Bottleneck(nn.Module):
    """A ResNet bottleneck: 1x1, 3x3, 1x1 convs with BN, a projection when the width changes."""

    def __init__(self, inputs: int, width: int, outputs: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(inputs, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, outputs, 1, bias=False), nn.BatchNorm2d(outputs)
        self.downsample = None if inputs == outputs else nn.Sequential(
            nn.Conv2d(inputs, outputs, 1, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn3(self.conv3(F.relu(self.bn2(self.conv2(y)))))
        return F.relu(y + (x if self.downsample is None else self.downsample(x)))


class ResLayer(nn.Sequential):
    """A stage of bottlenecks, as mmpretrain's ResLayer (a ``Sequential`` of blocks)."""

    def __init__(self, inputs: int, width: int, blocks: int) -> None:
        super().__init__(*(Bottleneck(inputs if i == 0 else 4 * width, width, 4 * width)
                           for i in range(blocks)))


@MODELS.register_module(force=True)
class BottleneckResNet(BaseModel):
    """A ResNet-50-like classifier (stem, four stages of bottlenecks, head), scaled down."""

    def __init__(self, data_preprocessor=None, width=8, depths=(3, 4, 6, 3), classes=4):
        super().__init__(data_preprocessor=data_preprocessor)
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        inputs, stages = width, []
        for i, depth in enumerate(depths):
            stages.append(ResLayer(inputs, width * 2**i, depth))
            inputs = 4 * width * 2**i
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(inputs, classes)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        logits = self.head(self.stages(self.stem(inputs)).mean((2, 3)))
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, torch.as_tensor(data_samples)))
        return logits


class Attention(nn.Module):
    """Multi-head self-attention over tokens (B, N, C)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class EncoderLayer(nn.Module):
    """A pre-norm ViT encoder layer: attention and an MLP (``FFN``), each a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(dim), Attention(dim, heads), nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


@MODELS.register_module(force=True)
class TinyViT(BaseModel):
    """A ViT classifier: patch embedding, a class token, encoder layers, a norm and a head."""

    def __init__(self, data_preprocessor=None, dim=32, depth=4, heads=4, patch=8, size=32,
                 classes=4):
        super().__init__(data_preprocessor=data_preprocessor)
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + (size // patch)**2, dim))
        self.layers = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        x = self.patch_embed(inputs).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], 1) + self.pos_embed
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)[:, 0])
        if mode == 'loss':
            return dict(loss=F.cross_entropy(logits, torch.as_tensor(data_samples)))
        return logits
