"""keras.io's knowledge distillation through hvdtrain.fit, on Fashion-MNIST: a teacher trained
first, then a Distiller with its own compile() arguments and compute_loss, trained by Keras'
default train_step on every rank.

    horovodrun -np 2 python examples/distillation.py

Hinton et al. 2015, "Distilling the Knowledge in a Neural Network"; the Distiller is keras.io's
("Knowledge Distillation" on keras.io), unchanged but for its size. fit runs twice in one
process: the teacher's, then the distiller's.
"""
import argparse

import keras
from keras import ops

import hvdtrain
from hvdtrain.data.in_memory import load_idx_dir

p = argparse.ArgumentParser()
p.add_argument("--train", type=int, default=20000)
p.add_argument("--test", type=int, default=5000)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--log-dir", default="runs/distillation")
a = p.parse_args()


class Distiller(keras.Model):
    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1, temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(ops.softmax(teacher_pred / self.temperature, axis=1),
                                                      ops.softmax(y_pred / self.temperature, axis=1))
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss * self.temperature ** 2

    def call(self, x):
        return self.student(x)


def convnet(width: int) -> keras.Model:
    return keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Rescaling(1 / 255),
                             keras.layers.Conv2D(width, 3, strides=2, activation="relu"),
                             keras.layers.Conv2D(2 * width, 3, strides=2, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(10)])


hvdtrain.init_distributed()  # first: each rank pins its own GPU before TensorFlow starts
keras.utils.set_random_seed(0)  # the same run every time (rank 0's initial weights are broadcast)
fashion = load_idx_dir("/usr/share/datasets/fashion-mnist")
x, y = fashion.x_train[:a.train], fashion.y_train[:a.train]
test = (fashion.x_test[:a.test], fashion.y_test[:a.test])
xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
teacher = convnet(32)
teacher.compile(keras.optimizers.Adam(2e-3), loss=xent, metrics=["accuracy"])
taught = hvdtrain.fit(teacher, x=x, y=y, validation_data=test, epochs=a.epochs, batch_size=64,
                      log={"dir": f"{a.log_dir}/teacher", "progress": False})
distiller = Distiller(student=convnet(8), teacher=taught.model)
distiller.compile(keras.optimizers.Adam(2e-3), metrics=["accuracy"], student_loss_fn=xent,
                  distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=5)
result = hvdtrain.fit(distiller, x=x, y=y, validation_data=test, epochs=a.epochs, batch_size=64,
                      log={"dir": f"{a.log_dir}/student", "progress": False})
if result.is_chief:
    print(f"teacher test accuracy {taught.history[-1]['test_accuracy']:.4f}, "
          f"student test accuracy {result.history[-1]['test_accuracy']:.4f}")
