# Seed 000's DataParallel example, as published.
import torch
from torch.nn.parallel import DataParallel

# the model
model = torch.nn.Linear(10, 1)

# wrap the model in DataParallel
model = DataParallel(model)

# the data
x = torch.randn(10, 10)
y = torch.randn(10, 1)

# training
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for epoch in range(100):
    optimizer.zero_grad()
    outputs = model(x)
    loss = torch.nn.MSELoss()(outputs, y)
    loss.backward()
    optimizer.step()

# the result
print(outputs)
