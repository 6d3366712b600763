# Seed 000's single-GPU example, as published.
import torch

# the model
model = torch.nn.Linear(10, 1)

# move the model to the GPU
model.cuda()

# the data
x = torch.randn(10, 10).cuda()
y = torch.randn(10, 1).cuda()

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
